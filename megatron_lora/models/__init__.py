"""Model definitions: megatron-core specs and builders for the model families we support."""
