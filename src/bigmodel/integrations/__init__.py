"""Integrations with the Hugging Face libraries: one-call loading of their model folders."""
