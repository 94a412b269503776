"""Reading an HF model directory's weights back in tests."""
import os


def read_safetensors(d: str) -> dict:
    """Every tensor of every *.safetensors file in directory d, by name."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out
