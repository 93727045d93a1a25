// llama-logits: llama.cpp's own logits for a token sequence, or its
// tokenisation of a text — the reference side of scripts/compare-llama-cpp.
//
//   llama-logits MODEL.gguf logits IDS_CSV OUT.bin [FROM]
//                                                    # f32 [n_ids - FROM][n_vocab]
//   llama-logits MODEL.gguf tokenize TEXT_FILE       # ids, one line, comma separated
//                                                    # (add_special = model default,
//                                                    #  special tokens parsed)
//
// Built against the same llama.cpp build as the benchmark peers
// (scripts/build-llama-cpp); CPU only, 2 threads, one sequence, every
// position's logits in one batch.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static void quiet(ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL logits IDS_CSV OUT | MODEL tokenize TEXT_FILE\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const std::string mode = argv[2];
    if (mode == "tokenize") {
        std::ifstream f(argv[3], std::ios::binary);
        std::stringstream ss; ss << f.rdbuf();
        const std::string text = ss.str();
        std::vector<llama_token> ids(text.size() + 16);
        int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), true, true);
        if (n < 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
        for (int i = 0; i < n; i++) printf(i ? ",%d" : "%d", ids[i]);
        printf("\n");
        return 0;
    }
    if (mode != "logits" || argc < 5) { fprintf(stderr, "bad mode\n"); return 2; }
    std::vector<llama_token> ids;
    {
        std::stringstream ss(argv[3]);
        std::string tok;
        while (std::getline(ss, tok, ',')) ids.push_back((llama_token) atoi(tok.c_str()));
    }
    const int n = (int) ids.size();
    const int from = argc > 5 ? atoi(argv[5]) : 0;
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n < 64 ? 64 : n + 8;
    cp.n_batch = cp.n_ctx;
    cp.n_ubatch = cp.n_ctx;
    cp.n_threads = 2;
    cp.n_threads_batch = 2;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create context\n"); return 1; }
    llama_batch batch = llama_batch_init(n, 0, 1);
    for (int i = 0; i < n; i++) {
        batch.token[i] = ids[i];
        batch.pos[i] = i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = i >= from;
    }
    batch.n_tokens = n;
    if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(vocab);
    FILE * out = fopen(argv[4], "wb");
    for (int i = from; i < n; i++) fwrite(llama_get_logits_ith(ctx, i), sizeof(float), n_vocab, out);
    fclose(out);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
