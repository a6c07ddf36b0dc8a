"""The parts of docs/gen_reference.py, the reference pages' generator: describing one field
(`fields`), the tables of pydantic models and dataclasses (`model_pages`), the CLI page
(`cli_reference`) and the metrics page (`metrics_reference`). gen_reference.py puts this folder on
`sys.path`; mkdocs skips these files (`exclude_docs` in mkdocs.yml)."""
