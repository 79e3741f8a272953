"""Sample order: shuffles keyed by (seed, epoch), the rank sampler, the inter-node exchange, shuffle quality."""
