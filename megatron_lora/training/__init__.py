"""Training: forward/backward steps over megatron-core's pipeline schedules."""
