"""Model building blocks: quantization-aware linears and embeddings, and op-dispatched layers."""
