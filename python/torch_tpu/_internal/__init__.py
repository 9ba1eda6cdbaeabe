"""TorchTPU-compatible internal namespace (`torch_tpu._internal.*`)."""
