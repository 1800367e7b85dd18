"""Images in prompts (vision-language models): reading verl's image cells, the processor that turns a
prompt with ``<image>`` placeholders into token ids with image-pad runs and pixel patches, and the
checks a VL recipe gets before any compute (docs/vision.md)."""
