"""BERT sentence encoders (all-MiniLM and kin): embeddings, not generation."""

from shoal.engine.models.families.family import ModelFamily

BERT = ModelFamily(
    name="bert",
    model="shoal.engine.models.bert:load_bert",
    task="embed",
    hf_architectures=("BertModel", "BertForMaskedLM"),
    hf_model_types=("bert",),
    gguf_architectures=("bert",),
    # models/bert.py reads config.json and the checkpoint's own tensor names itself.
)
