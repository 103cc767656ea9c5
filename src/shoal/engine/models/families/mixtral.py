"""Mixtral: llama attention with each MLP replaced by top-2 routing over 8 experts.

llama.cpp writes Mixtral GGUF files as general.architecture "llama" with expert tensors and
llama.expert_count: the llama family reads them (its tensor names and q/k order) and says
"mixtral" in their config. This declaration names the config.json checkpoints
(block_sparse_moe.experts.N.w1/w2/w3).
"""

from __future__ import annotations

from functools import partial

from shoal.engine.models.families.experts import hf_expert_config
from shoal.engine.models.families.family import ModelFamily

MIXTRAL = ModelFamily(
    name="mixtral",
    model="shoal.engine.models.llama:LlamaModel",
    hf_architectures=("MixtralForCausalLM",),
    hf_model_types=("mixtral",),
    tensor_tables="llama",
    # Every expert is intermediate_size wide; the top-k weights always sum to 1.
    hf_config_extras=partial(hf_expert_config, expert_size_key="intermediate_size",
                             norm_topk_prob=True),
)
