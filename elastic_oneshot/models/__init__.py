"""Model families: the source checkpoint, MoE experts, stored names, what transformers loads."""
