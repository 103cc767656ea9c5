"""One model instance over several ranks: pipeline stages or tensor shards (torch.distributed)."""
