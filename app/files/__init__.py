"""Uploaded files: upload, index in the collections engine, retrieval (the text is
read by `app/extract.py`)."""
