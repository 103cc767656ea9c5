"""The node's model pool: policy over the runner registry for the instances served here
(keep-alive, eviction, the admission queue and client tiers, the names clients use)."""
