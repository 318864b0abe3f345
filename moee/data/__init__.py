"""Real, offline text data: source readers (``sources``), the evaluation/training split
(``exclusions``), the training corpus (``corpus``), the tokenizer (``tokenizer``) and the committed
offline evaluation sets (``offline``). See ``data/SOURCES.md`` for licences and citations."""
