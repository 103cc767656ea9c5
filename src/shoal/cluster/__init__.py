"""The cluster: event-sourced state, placement, the worker's plan and their drivers."""
