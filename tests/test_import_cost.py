"""Importing paramupdates must not import torch._dynamo (about a second of start-up), nor any framework."""

import subprocess
import sys


def test_import_does_not_load_dynamo():
    code = (
        "import sys, paramupdates, torch; torch.compiler.is_compiling(); "
        "print([m for m in ('torch._dynamo', 'timm', 'torchvision', 'lightning', 'accelerate') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
