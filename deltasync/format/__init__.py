"""The format in code (docs/FORMAT.md): stored documents, objects, codecs and checksums. Imports nothing above it."""
