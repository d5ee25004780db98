"""A multi-module agent runtime (labelled): values reach the prompt through attributes and helpers."""
