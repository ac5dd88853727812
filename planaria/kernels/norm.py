"""RMSNorm, computed in float32 like the reference implementations; on the CPU it runs
the one-op C++ kernel of csrc/rms_norm.cpp where it is built (kernels/cpu_ext.py): one op
instead of seven small ones, which at decode batches cost more than their arithmetic
(33 norms a step in bench-moe). float32 sums in another order than torch's mean, so its
results differ in the last bits (the float32 parity tests still compare tokens exactly)."""

import torch

from planaria.kernels import cpu_ext


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., H]; weight: [H]
    dtype = x.dtype
    if (x.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16) and weight.dtype == dtype
            and x.dim() in (2, 3) and x.stride(-1) == 1 and cpu_ext.available()):
        return torch.ops.planaria.rms_norm(x, weight, eps)  # one op (kernels/csrc/rms_norm.cpp)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
