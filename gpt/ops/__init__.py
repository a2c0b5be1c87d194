"""Kernels: the fast implementations the model calls, each beside its plain reference.

`gpt/model.py` says *what* is computed; these modules say *how* on a given machine. Which one runs
is decided once, when the model is built (`gpt.runtime.Runtime`), and passed down as arguments.
"""
