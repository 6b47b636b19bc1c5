"""Text grammars shared by the tokenizer and the executor: regular expressions as NFAs,
JSON Schema as a regular expression, and token-level automata for constrained decoding."""
