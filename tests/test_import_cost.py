"""Importing paramupdates must not import torch._dynamo (about a second of start-up)."""

import subprocess
import sys


def test_import_does_not_load_dynamo():
    code = "import sys, paramupdates, torch; torch.compiler.is_compiling(); print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
