"""Images through diffusers: a pipeline directory's files (files.py, no torch) and the
pipeline loaded for serving (pipeline.py, torch and diffusers; the image runner imports it)."""
