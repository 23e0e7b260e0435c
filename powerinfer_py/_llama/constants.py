"""llama.cpp's enum values that Llama's signature uses, written out so that importing
powerinfer_py.llama does not load llama_cpp, and the names of the engines and modes."""

LLAMA_DEFAULT_SEED = 0xFFFFFFFF
LLAMA_SPLIT_MODE_NONE = 0
LLAMA_SPLIT_MODE_LAYER = 1
LLAMA_SPLIT_MODE_ROW = 2
LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1
LLAMA_POOLING_TYPE_UNSPECIFIED = -1
LLAMA_POOLING_TYPE_NONE = 0
LLAMA_POOLING_TYPE_MEAN = 1
LLAMA_POOLING_TYPE_CLS = 2
LLAMA_POOLING_TYPE_LAST = 3
LLAMA_POOLING_TYPE_RANK = 4
LLAMA_ATTENTION_TYPE_UNSPECIFIED = -1

ENGINE_POWERINFER = "powerinfer"
ENGINE_LLAMA_CPP = "llama-cpp-python"

# Which neurons the FFN computes: every one ("dense"), those whose gate fires ("gate"),
# those a trained predictor selects ("predictor"), or the best the file allows ("auto");
# "input": every matrix reads only the columns of its input's kept entries (powerinfer sparsify).
SPARSE_MODES = ("auto", "dense", "gate", "predictor", "input")
