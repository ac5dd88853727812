"""One module per `planaria` subcommand; see daemon/cli.py for the module contract."""
