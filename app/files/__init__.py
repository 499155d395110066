"""Uploaded files: extraction, chunking, indexing and retrieval."""
