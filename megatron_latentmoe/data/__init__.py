"""Embedded default corpus + tokenizer, and JSONL -> Megatron indexed dataset preprocessing."""
