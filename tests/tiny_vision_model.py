"""A tiny random-weight vision model for llama-server, made offline: transformers builds an
Idefics3 checkpoint (SmolVLM's architecture: a SigLIP-style vision tower, a pixel-shuffle
connector) from a config, and llama.cpp's own `convert_hf_to_gguf.py --mmproj` turns its
vision half into the projector GGUF; the text half is tests/random_gguf.py's random llama of
the projector's output width. Nothing comes from a model hub.

The converter, its `conversion` package and its gguf-py come from the llama.cpp tree inside
llama-cpp-python's source distribution (the one tests/llama_server_build.py builds
llama-server from), kept by make test's install step under
~/.cache/shoal/llama-converter/<version>/tree (tests/llama_server_build.py). The projector is
cached beside it by its config, so only the first run pays for transformers and the
conversion (~15 s on two cores); later runs copy ~100 KB.

`python tests/tiny_vision_model.py OUT.gguf` (run with the tree on PYTHONPATH) builds one.
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Vision tower: 32x32 pixels in 8x8 patches (16), merged 2x2 by the connector: 4 tokens a
# tile. Text width: the projector's output, the random llama's hidden size.
TEXT_WIDTH = 64
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
          "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
TEXT = {"model_type": "llama", "hidden_size": TEXT_WIDTH, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 300}
PREPROCESSOR = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "size": {"longest_edge": 32}}
# The tokens llama.cpp's Idefics3 projector wraps an image's embeddings in, looked up in the
# text model's vocabulary by their text: (byte-level text, GGUF token type: 1 normal,
# 3 control). "ĊĊ" is "\n\n"; "\n" is a byte token already.
IMAGE_MARKER_TOKENS = (("ĊĊ", 1), ("<fake_token_around_image>", 3), ("<global-img>", 3))


def _cache_root() -> Path:
    from llama_server_build import converter_dir

    return converter_dir().parent


def converter_tree() -> Path:
    """llama.cpp's converter for the version llama-server is built from (make test's
    install step keeps it; fetched here only if it has not)."""
    from llama_server_build import fetch_converter

    return fetch_converter()


def tiny_projector(target: Path) -> Path:
    """Writes the projector GGUF to target (from the cache when it holds this config)."""
    key = hashlib.sha256(json.dumps([VISION, TEXT, PREPROCESSOR]).encode()).hexdigest()[:16]
    cached = _cache_root() / f"mmproj-tiny-{key}.gguf"
    if not cached.is_file():
        tree = converter_tree()
        partial = cached.with_suffix(".partial")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(tree / "gguf-py"), str(tree), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, __file__, str(partial)], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        partial.rename(cached)
    shutil.copy2(cached, target)
    return target


def _build(out: Path) -> None:
    """The checkpoint (transformers, seeded) converted to out (llama.cpp's converter)."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    torch.manual_seed(0)
    config = Idefics3Config(vision_config=VISION, text_config=TEXT, scale_factor=2)
    with tempfile.TemporaryDirectory(prefix="shoal-tiny-vision-") as scratch:
        checkpoint = Path(scratch)
        Idefics3ForConditionalGeneration(config).save_pretrained(checkpoint)
        (checkpoint / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
        script = "convert_hf_to_gguf.py"
        converter = next(Path(p) for p in sys.path if (Path(p) / script).is_file())
        sys.argv = [script, str(checkpoint), "--mmproj", "--outtype", "f32",
                    "--outfile", str(out)]
        runpy.run_path(str(converter / script), run_name="__main__")


if __name__ == "__main__":
    _build(Path(sys.argv[1]))
