"""Generation backends (`hf`, `vllm`) behind one interface, and the generation worker actor."""
