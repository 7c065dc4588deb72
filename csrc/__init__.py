"""CUDA/C sources of buddy, shipped as package data (``buddy.csrc``) and compiled at run time."""
