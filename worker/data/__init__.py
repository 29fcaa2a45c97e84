"""The data path: records read from files, the one encoder, token stores, a phase's batches,
dataset inspection and the tokenizer. Imports worker's shared modules only (error, files), no
other worker subpackage."""
