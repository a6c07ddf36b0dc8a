"""A setting declared once: pydantic fields become command-line flags (`flags.py`), with
the argparse actions every package's CLI shares. Imports nothing else from ctxgate.
"""
