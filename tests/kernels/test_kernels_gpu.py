"""The kernels and a short engine generate on CUDA, in float32 and bfloat16, against the
CPU reference (the naive references of tests/kernels/_cases.py and the same kernels run
on CPU in float32). Marked ``gpu``: skipped where torch.cuda.is_available() is False
(tests/conftest.py)."""

import pytest
import torch

from planaria.kernels.attention import paged_attention
from planaria.kernels.moe import grouped_expert_mlp, route
from planaria.kernels.norm import rms_norm
from planaria.kernels.rotary import RotaryEmbedding
from tests.kernels._cases import (attention_case, attention_inputs, attention_reference, moe_case,
                                  moe_reference, rms_norm_reference, rope_config, rope_frequencies)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
# (dtype, rtol, atol) for O(1) values: float32 up to reduction order, bfloat16 to ~3 digits
DTYPES = [(torch.float32, 1e-4, 1e-4), (torch.bfloat16, 3e-2, 3e-2)]
IDS = ["fp32", "bf16"]


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    torch.testing.assert_close(got.detach().double().cpu(), want.detach().double().cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype, rtol, atol", DTYPES, ids=IDS)
def test_paged_attention_gpu_matches_cpu(dtype, rtol, atol):
    case = attention_case(seed=5)
    (q, k, v, kc, vc, md), pick = attention_inputs(case, DEVICE, dtype)
    out = paged_attention(q, k, v, kc, vc, md, case.scale)
    torch.cuda.synchronize()
    assert out.is_cuda and out.dtype == dtype
    _close(out, attention_reference(case, pick), rtol, atol)
    (q, k, v, kc, vc, md), _ = attention_inputs(case, "cpu", torch.float32)
    _close(out, paged_attention(q, k, v, kc, vc, md, case.scale), rtol, atol)


@pytest.mark.parametrize("dtype, rtol, atol", DTYPES, ids=IDS)
@pytest.mark.parametrize("num_tokens, favour", [(256, None), (1, None), (64, [2, 5])],
                         ids=["bmm", "decode-loop", "skewed-loop"])
def test_moe_gpu_matches_cpu(dtype, rtol, atol, num_tokens, favour):
    case = moe_case(num_tokens, seed=num_tokens, favour=favour)
    w_cpu, ids_cpu = route(case.router_logits, case.top_k, True)
    w, ids = route(case.router_logits.to(DEVICE, dtype), case.top_k, True)
    if dtype == torch.float32:
        assert torch.equal(ids.cpu(), ids_cpu)
    # the expert mix is compared on the CPU's routing, so a bf16 near-tie cannot swap experts
    out = grouped_expert_mlp(case.x.to(DEVICE, dtype), case.w13.to(DEVICE, dtype), case.w2.to(DEVICE, dtype),
                             w_cpu.to(DEVICE, dtype), ids_cpu.to(DEVICE))
    assert out.is_cuda and out.dtype == dtype
    _close(out, moe_reference(case, w_cpu, ids_cpu), rtol, atol)
    _close(out, grouped_expert_mlp(case.x, case.w13, case.w2, w_cpu, ids_cpu), rtol, atol)
    _close(w.float(), w_cpu, rtol, atol)


@pytest.mark.parametrize("dtype, rtol, atol", DTYPES, ids=IDS)
def test_rms_norm_gpu_matches_cpu(dtype, rtol, atol):
    x, w = torch.randn(33, 256) * 4, torch.rand(256) + 0.5
    out = rms_norm(x.to(DEVICE, dtype), w.to(DEVICE, dtype), 1e-6)
    assert out.is_cuda and out.dtype == dtype
    _close(out, rms_norm_reference(x, w, 1e-6), rtol, atol)


@pytest.mark.parametrize("dtype, rtol, atol", DTYPES, ids=IDS)
@pytest.mark.parametrize("rope_type", ["default", "yarn"])
def test_rotary_gpu_matches_cpu(dtype, rtol, atol, rope_type):
    cfg = rope_config(rope_type)
    positions = torch.tensor([0, 3, 255, 256, 2047, 9])
    q, k = torch.randn(6, 4, 32), torch.randn(6, 2, 32)
    inv_freq, scaling = rope_frequencies(cfg)
    cpu = RotaryEmbedding(inv_freq, 2048, torch.float32, scaling)
    gpu = RotaryEmbedding(inv_freq, 2048, dtype, scaling).to(DEVICE)
    oq, ok = gpu(positions.to(DEVICE), q.to(DEVICE, dtype), k.to(DEVICE, dtype))
    rq, rk = cpu(positions, q, k)
    # bf16 cos/sin tables lose ~3 digits; positions up to 2047 keep that relative error
    _close(oq, rq, rtol, atol * 2)
    _close(ok, rk, rtol, atol * 2)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense"])
def test_engine_generate_on_gpu(demo_models, preset):
    from planaria.engine import LLM, SamplingParams

    model = demo_models(preset)
    prompts = [[3 + (7 * i + j) % 4000 for i in range(n)] for j, n in enumerate([1, 5, 17, 40, 90, 130, 200, 33])]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    common = dict(max_num_seqs=8, max_num_batched_tokens=256, kv_cache_bytes=16 * 2**20)
    want = [o.token_ids for o in LLM(model, **common).generate(prompts, sp)]
    got32 = LLM(model, device=DEVICE, dtype="float32", **common).generate(prompts, sp)
    assert [o.token_ids for o in got32] == want  # float32 on GPU: the same greedy tokens
    bf16 = LLM(model, device=DEVICE, dtype="bfloat16", **common)
    a = bf16.generate(prompts, sp)
    b = bf16.generate(prompts, sp)  # second pass: prefix-cache hits on the GPU cache
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in a)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.num_cached_tokens for o in b) > 0
    # bf16 may flip near-ties later on; the first token of most prompts must agree
    assert sum(o.token_ids[0] == w[0] for o, w in zip(a, want)) >= 6
