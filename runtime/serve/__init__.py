"""Serving: the OpenAI-compatible HTTP app over one decode core, its worker, schema, metrics and Ray Serve.

Arrows point one way: this package imports the decode core (runtime/); nothing in the core imports it.
"""
