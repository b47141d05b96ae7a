"""`python -m nanovllm`: the `nanovllm` command line. Only `-m` runs this module: importing `nanovllm` never
imports the command line."""
from nanovllm_cli.main import app

app(prog_name="nanovllm")
