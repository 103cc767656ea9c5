"""What a node tells about itself when something goes wrong: versions, configuration with
secrets removed, memory, each runner's flight recorder and the node's recent errors
(GET /v1/diagnostics/node, /v1/diagnostics/cluster, `shoal diagnose`)."""
