"""Build-time code for the data moee ships: the source readers (``sources``), the evaluation/training
split (``exclusions``), the training corpus and its leak checks (``corpus``) and the tokenizer trainer
(``tokenizer``), driven by ``scripts/build_{offline_data,corpus,tokenizer}.py``.

It lives in the checkout beside ``moee/`` and is not part of the installed ``moee`` package: the
runtime only reads what these builders wrote (``moee.data.offline_tasks``). See ``data/SOURCES.md``
for the sources' licences and citations.
"""
