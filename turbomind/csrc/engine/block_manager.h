// The KV cache's blocks: who holds which, and which full blocks can be reused as a prefix.
// The C++ twin of pytorch_backend/block_manager.py, same operations, same states, same
// order of block ids; the scheduler decides when to call it.
//
// The pool has num_blocks blocks of block_size token slots. Each block is in exactly one state:
//   free:   ref count 0, holds nothing reusable (FIFO queue)
//   cached: ref count 0, holds a full block registered in the prefix cache (LRU list, least
//           recently freed first); reusable by a prefix hit, or evicted (forgotten) when a
//           fresh block is needed
//   used:   ref count > 0, held by that many sequences (it may also be registered, so other
//           sequences can share it)
//
// A full block's key is block_key(parent key, its token ids), a 64-bit hash chain starting at
// root_key(the sequence's adapter_uid): kRootKey for the base model, a root of its own for each
// loaded LoRA adapter, so blocks computed with an adapter only ever serve its requests. The block's tokens and parent key are kept beside the key: a key hit whose tokens or
// parent differ is a collision and counts as a miss. Only full, computed blocks are keyed.
//
// With a sliding window on every layer (Mistral), a sequence gives back the blocks no query of it
// reads again, those wholly before its next query's window (release_outside_window): their place
// in block_ids holds kReleased, so block i still holds tokens [i*block_size, ...); the attention
// kernels never read a released entry.
//
// Not thread-safe: the engine thread owns it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

namespace turbomind {

// What the block manager reads and writes of a sequence (pytorch_backend/sequence.py's fields of
// the same names). The engine's sequence holds one of these.
struct BlockSequence {
    // the whole context: earlier turns, this turn's prompt, generated tokens
    std::vector<int32_t> token_ids;
    // tokens whose K/V are in the cache
    int64_t num_computed_tokens = 0;
    // KV blocks in order; block i holds tokens [i*block_size, (i+1)*block_size)
    std::vector<int32_t> block_ids;
    // hash chain of the leading full blocks (prefix-cache keys)
    std::vector<uint64_t> block_hashes;
    // the LoRA adapter's load (lmd.lora.AdapterSlot.uid) its K/V is computed with; 0: the base model
    uint64_t adapter_uid = 0;

    int64_t num_tokens() const { return (int64_t) token_ids.size(); }
};

struct PrefixMatch {
    std::vector<int32_t> block_ids;  // cached blocks holding the leading full blocks, in order
    int64_t num_cached_tokens = 0;   // block_ids.size() * block_size
};

// The parent key of a sequence's first block (the Python version's _ROOT_HASH).
constexpr uint64_t kRootKey = 0x6C6D64;
// A block_ids entry a sliding window no longer reads, given back (the Python version's RELEASED).
constexpr int32_t kReleased = -1;

// The key of a full block: splitmix64-style mixing of the parent key, the token count and each
// token id. Deterministic across runs and machines.
uint64_t block_key(uint64_t parent, const int32_t * tokens, int64_t n);
// The parent key of a sequence's first block: kRootKey for salt 0 (the base model), else a root
// mixed from the salt (a LoRA adapter's uid; pytorch_backend/block_manager.py's _root_key).
uint64_t root_key(uint64_t salt);

class BlockManager {
public:
    // num_blocks >= 1, block_size >= 1, window >= 0 (the caller checks; the binding raises ValueError);
    // window > 0: every layer reads only a query's last `window` tokens
    BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching, int64_t window = 0);

    int32_t num_blocks() const { return num_blocks_; }
    int32_t block_size() const { return block_size_; }
    bool enable_prefix_caching() const { return enable_prefix_caching_; }
    int64_t window() const { return window_; }

    // ---- counters
    int32_t num_free_blocks() const { return (int32_t) free_.size(); }
    int32_t num_cached_blocks() const { return num_cached_; }  // free but holding a reusable prefix
    int32_t num_used_blocks() const { return num_blocks_ - num_free_blocks() - num_cached_; }
    int32_t num_available_blocks() const { return num_free_blocks() + num_cached_; }  // free, then evictable
    int64_t blocks_needed(int64_t num_tokens) const { return (num_tokens + block_size_ - 1) / block_size_; }
    // The most blocks a sequence of num_tokens holds at once, computed chunk tokens a step: all of
    // them, or with a window those of a window and a chunk (one more where they straddle a boundary).
    int64_t blocks_held(int64_t num_tokens, int64_t chunk) const {
        const int64_t n = blocks_needed(num_tokens);
        return window_ > 0 ? std::min(n, blocks_needed(window_ - 1 + chunk) + 1) : n;
    }
    // prompt tokens served from the prefix cache / looked up in it, counted once per admission
    int64_t num_prefix_hit_tokens() const { return num_prefix_hit_tokens_; }
    int64_t num_prefix_query_tokens() const { return num_prefix_query_tokens_; }

    // ---- the scheduler's interface

    // The cached blocks holding the longest run of full leading blocks of tokens[0, n). Takes no
    // reference: hand the ids to allocate() in the same step. At most n - 1 tokens match, so the
    // last token is always recomputed (its logits are needed). salt: the sequence's adapter_uid.
    PrefixMatch match_prefix(const int32_t * tokens, int64_t n, uint64_t salt = 0) const;
    PrefixMatch match_prefix(const std::vector<int32_t> & tokens, uint64_t salt = 0) const {
        return match_prefix(tokens.data(), (int64_t) tokens.size(), salt);
    }

    // Give seq blocks for its first num_tokens tokens; false (and no change) if too few are left.
    // prefix_block_ids (from match_prefix, only for a sequence holding no blocks yet) become its
    // leading blocks, shared with whoever else holds them; with a window, those wholly before its
    // first query's window are kReleased at once, never taken. Preconditions (checked by the
    // binding): prefix only when seq.block_ids is empty; prefix ids are registered blocks.
    bool allocate(BlockSequence & seq, int64_t num_tokens, const std::vector<int32_t> & prefix_block_ids = {});

    // Drop seq's hold on its blocks (last block first, so a tail is evicted before its shared
    // head); registered ones stay reusable until evicted. False, and no change, if seq holds a
    // block more often than it is referenced (a double free: a bug in the caller).
    bool free(BlockSequence & seq);

    // allocate without a prefix, from free blocks only: false (and no change) where it would evict a
    // cached one (speculative decoding's drafts, likely given back at once, spare the prefix cache).
    bool allocate_free(BlockSequence & seq, int64_t num_tokens);

    // Give back seq's blocks past the ones its first num_tokens tokens need, last first (speculative
    // decoding: the blocks rejected drafts took). They hold no registered content: only computed
    // tokens' full blocks are keyed.
    void rollback(BlockSequence & seq, int64_t num_tokens);

    // Register seq's blocks that are full and computed (num_computed_tokens) in the prefix cache.
    void cache_full_blocks(BlockSequence & seq);

    // With a window: give back seq's blocks wholly before the window of its next query (at position
    // num_computed_tokens, which reads keys from num_computed_tokens - window + 1 on).
    void release_outside_window(BlockSequence & seq);

    // "" when the accounting is right, else what is wrong. seqs: every sequence holding blocks
    // (nullptr: skip the check of ref counts against them).
    std::string check_invariants(const std::vector<const BlockSequence *> * seqs = nullptr) const;

    // ---- introspection for tests
    int32_t ref_count(int32_t block) const { return ref_counts_[block]; }
    bool is_registered(int32_t block) const { return has_key_[block] != 0; }
    std::vector<int32_t> free_block_ids() const { return {free_.begin(), free_.end()}; }
    std::vector<int32_t> cached_block_ids() const;  // least recently freed first (next to evict)
    // Test hook: keys are and-ed with mask (0: every key equal), to force hash collisions.
    void set_key_mask(uint64_t mask) { key_mask_ = mask; }

private:
    uint64_t key_of(uint64_t parent, const int32_t * tokens) const;
    bool block_matches(int32_t b, uint64_t parent, const int32_t * tokens) const;
    int32_t take_block();
    void drop(int32_t b);  // one holder less; at none: free, or cached if registered
    void lru_push_back(int32_t b);
    void lru_remove(int32_t b);

    int32_t num_blocks_;
    int32_t block_size_;
    bool enable_prefix_caching_;
    int64_t window_;
    uint64_t key_mask_ = ~uint64_t(0);

    std::vector<int32_t> ref_counts_;
    std::deque<int32_t> free_;
    // cached blocks: a doubly linked list through lru_prev_/lru_next_ (index num_blocks_ is the
    // sentinel), so a hit takes a block out of the middle in O(1)
    std::vector<int32_t> lru_prev_, lru_next_;
    std::vector<uint8_t> in_lru_;
    int32_t num_cached_ = 0;

    // prefix cache: key -> block, and per block its key, parent key and tokens
    std::unordered_map<uint64_t, int32_t> key_to_block_;
    std::vector<uint8_t> has_key_;
    std::vector<uint64_t> block_key_;
    std::vector<uint64_t> block_parent_;
    std::vector<int32_t> block_tokens_;  // [num_blocks, block_size]

    int64_t num_prefix_hit_tokens_ = 0;
    int64_t num_prefix_query_tokens_ = 0;
};

}  // namespace turbomind
