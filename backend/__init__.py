"""The plumbing under the recipe: kernel selection, megatron-core 0.19.2's shims, the non-Transformer-Engine layer
spec, the torch and Triton Mamba-2 sets and the shared-prompt format's layers (docs/MODULES.md)."""
