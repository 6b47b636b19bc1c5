"""The tokenizer actor: text to token ids on the way in, token ids to text on the way out."""
