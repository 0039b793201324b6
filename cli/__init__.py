"""The application layer: the `dapo` command line, the local launcher, run reports and the model bootstrap.

It sits above the kernel (`services`) and the three services, and nothing below imports it.
"""
