"""The committed offline evaluation data (``offline/<task>/*.jsonl``) and its loader
(``offline_tasks``). The code that builds it lives outside the installed package, in
``moee_build/`` (``scripts/build_offline_data.py``); see ``data/SOURCES.md`` for licences and citations."""
