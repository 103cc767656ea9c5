"""A tiny Stable Diffusion pipeline with random weights, built offline from configs as
diffusers' own tests build theirs (nothing is downloaded): a two-block UNet, a two-block VAE,
a two-layer CLIP text encoder and a CLIP tokenizer over a vocabulary written here."""

from __future__ import annotations

import json
import string
from pathlib import Path


def write_clip_tokenizer_files(directory: Path) -> tuple[Path, Path]:
    """vocab.json and merges.txt of a tiny CLIP BPE: the two special tokens and each
    lower-case letter alone and word-final; anything else is the unknown token."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in string.ascii_lowercase:
        vocab[letter] = len(vocab)
        vocab[letter + "</w>"] = len(vocab)
    vocab_file, merges_file = directory / "vocab.json", directory / "merges.txt"
    vocab_file.write_text(json.dumps(vocab))
    merges_file.write_text("#version: 0.2\n")
    return vocab_file, merges_file


def build_tiny_pipeline(directory: Path):
    """A StableDiffusionPipeline of random weights (seeded), saved under directory (a diffusers
    pipeline dir with model_index.json); returns the pipeline."""
    import torch
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=16, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=16,
        norm_num_groups=2, attention_head_dim=2)
    vae = AutoencoderKL(
        block_out_channels=(4, 8), in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), norm_num_groups=2,
        sample_size=32)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
        pad_token_id=1, projection_dim=16))
    files = directory / "tokenizer-source"
    files.mkdir(parents=True, exist_ok=True)
    vocab_file, merges_file = write_clip_tokenizer_files(files)
    tokenizer = CLIPTokenizer(vocab_file=str(vocab_file), merges_file=str(merges_file),
                              model_max_length=77)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipeline = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        scheduler=scheduler, safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    pipeline.save_pretrained(directory / "tiny-sd")
    return pipeline
