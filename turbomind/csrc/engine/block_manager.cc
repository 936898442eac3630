// The block pool and its prefix cache; see block_manager.h for the states and invariants.
#include "engine/block_manager.h"

#include <algorithm>
#include <cstring>

namespace turbomind {

namespace {

inline uint64_t mix64(uint64_t z) {  // splitmix64's finalizer
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

}  // namespace

uint64_t block_key(uint64_t parent, const int32_t * tokens, int64_t n) {
    uint64_t h = mix64(parent + kGolden * (uint64_t) (n + 1));
    for (int64_t i = 0; i < n; ++i) {
        h = mix64(h + kGolden + (uint64_t) (uint32_t) tokens[i]);
    }
    return h;
}

uint64_t root_key(uint64_t salt) {
    return salt == 0 ? kRootKey : mix64(mix64(kRootKey + kGolden) ^ mix64(salt + kGolden));
}

BlockManager::BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching, int64_t window)
    : num_blocks_(num_blocks), block_size_(block_size), enable_prefix_caching_(enable_prefix_caching), window_(window),
      ref_counts_(num_blocks, 0), lru_prev_(num_blocks + 1), lru_next_(num_blocks + 1), in_lru_(num_blocks, 0),
      has_key_(num_blocks, 0), block_key_(num_blocks, 0), block_parent_(num_blocks, 0) {
    for (int32_t b = 0; b < num_blocks; ++b) free_.push_back(b);
    lru_prev_[num_blocks] = lru_next_[num_blocks] = num_blocks;  // empty list: the sentinel alone
    if (enable_prefix_caching) block_tokens_.assign((size_t) num_blocks * block_size, 0);
}

// ---- the LRU list of cached blocks

void BlockManager::lru_push_back(int32_t b) {
    const int32_t s = num_blocks_;
    const int32_t last = lru_prev_[s];
    lru_prev_[b] = last;
    lru_next_[b] = s;
    lru_next_[last] = b;
    lru_prev_[s] = b;
    in_lru_[b] = 1;
    ++num_cached_;
}

void BlockManager::lru_remove(int32_t b) {
    lru_next_[lru_prev_[b]] = lru_next_[b];
    lru_prev_[lru_next_[b]] = lru_prev_[b];
    in_lru_[b] = 0;
    --num_cached_;
}

std::vector<int32_t> BlockManager::cached_block_ids() const {
    std::vector<int32_t> out;
    out.reserve(num_cached_);
    for (int32_t b = lru_next_[num_blocks_]; b != num_blocks_; b = lru_next_[b]) out.push_back(b);
    return out;
}

// ---- keys

uint64_t BlockManager::key_of(uint64_t parent, const int32_t * tokens) const {
    return block_key(parent, tokens, block_size_) & key_mask_;
}

bool BlockManager::block_matches(int32_t b, uint64_t parent, const int32_t * tokens) const {
    return block_parent_[b] == parent &&
           std::memcmp(&block_tokens_[(size_t) b * block_size_], tokens, sizeof(int32_t) * block_size_) == 0;
}

// ---- the scheduler's interface

PrefixMatch BlockManager::match_prefix(const int32_t * tokens, int64_t n, uint64_t salt) const {
    PrefixMatch m;
    if (!enable_prefix_caching_) return m;
    uint64_t parent = root_key(salt);
    // start + block_size < n: a block ending on the last token is never matched
    for (int64_t start = 0; start + block_size_ < n; start += block_size_) {
        const uint64_t key = key_of(parent, tokens + start);
        auto it = key_to_block_.find(key);
        if (it == key_to_block_.end() || !block_matches(it->second, parent, tokens + start)) break;
        m.block_ids.push_back(it->second);
        parent = key;
    }
    m.num_cached_tokens = (int64_t) m.block_ids.size() * block_size_;
    return m;
}

bool BlockManager::allocate(BlockSequence & seq, int64_t num_tokens, const std::vector<int32_t> & prefix_block_ids) {
    const int64_t num_needed = blocks_needed(num_tokens);
    const int64_t num_held = (int64_t) seq.block_ids.size();
    if (prefix_block_ids.empty() && num_needed <= num_held) return true;  // the common decode step
    const int64_t num_new = std::max<int64_t>(0, num_needed - num_held - (int64_t) prefix_block_ids.size());
    // a hit on a cached (evictable) block takes it out of the pool allocation draws from
    const int64_t num_prefix = (int64_t) prefix_block_ids.size();
    const int64_t skip = window_ > 0 ? std::max<int64_t>(0, num_prefix * block_size_ - window_ + 1) / block_size_ : 0;
    int64_t num_revived = 0;
    for (int64_t i = skip; i < num_prefix; ++i) num_revived += ref_counts_[prefix_block_ids[i]] == 0;
    if (num_new + num_revived > num_available_blocks()) return false;
    if (seq.block_ids.empty() && enable_prefix_caching_) {  // admission: count this prompt once
        num_prefix_query_tokens_ += seq.num_tokens();
        num_prefix_hit_tokens_ += (int64_t) prefix_block_ids.size() * block_size_;
    }
    for (int64_t i = 0; i < num_prefix; ++i) {
        const int32_t b = prefix_block_ids[i];
        seq.block_hashes.push_back(block_key_[b]);
        if (i < skip) {
            seq.block_ids.push_back(kReleased);
            continue;
        }
        if (ref_counts_[b] == 0) lru_remove(b);
        ++ref_counts_[b];
        seq.block_ids.push_back(b);
    }
    for (int64_t i = 0; i < num_new; ++i) seq.block_ids.push_back(take_block());
    return true;
}

bool BlockManager::free(BlockSequence & seq) {
    // check first, so a double free changes nothing
    std::unordered_map<int32_t, int32_t> held;
    for (int32_t b : seq.block_ids) {
        if (b == kReleased) continue;
        if (b < 0 || b >= num_blocks_ || ++held[b] > ref_counts_[b]) return false;
    }
    for (auto it = seq.block_ids.rbegin(); it != seq.block_ids.rend(); ++it) {
        if (*it != kReleased) drop(*it);
    }
    seq.block_ids.clear();
    seq.block_hashes.clear();
    return true;
}

bool BlockManager::allocate_free(BlockSequence & seq, int64_t num_tokens) {
    const int64_t num_new = blocks_needed(num_tokens) - (int64_t) seq.block_ids.size();
    if (num_new > num_free_blocks()) return false;
    return allocate(seq, num_tokens);
}

void BlockManager::rollback(BlockSequence & seq, int64_t num_tokens) {
    const size_t keep = static_cast<size_t>(std::max<int64_t>(0, blocks_needed(num_tokens)));
    while (seq.block_ids.size() > keep) {
        if (seq.block_ids.back() != kReleased) drop(seq.block_ids.back());
        seq.block_ids.pop_back();
    }
    if (seq.block_hashes.size() > keep) seq.block_hashes.resize(keep);
}

void BlockManager::drop(int32_t b) {
    if (--ref_counts_[b] == 0) {
        if (has_key_[b]) {
            lru_push_back(b);
        } else {
            free_.push_back(b);
        }
    }
}

void BlockManager::release_outside_window(BlockSequence & seq) {
    if (window_ <= 0) return;
    const int64_t first_read = std::max<int64_t>(0, seq.num_computed_tokens - window_ + 1);
    // released entries are always a prefix: walk back from the last block to give back until one is
    // met, so a decode step does constant work however long the sequence
    for (int64_t i = std::min<int64_t>(first_read / block_size_, (int64_t) seq.block_ids.size()) - 1;
         i >= 0 && seq.block_ids[i] != kReleased; --i) {
        drop(seq.block_ids[i]);
        seq.block_ids[i] = kReleased;
    }
}

void BlockManager::cache_full_blocks(BlockSequence & seq) {
    if (!enable_prefix_caching_) return;
    // only blocks whose tokens are all known, computed and held
    const int64_t num_full = std::min(seq.num_computed_tokens, seq.num_tokens()) / block_size_;
    const int64_t num_keyable = std::min<int64_t>(num_full, (int64_t) seq.block_ids.size());
    std::vector<uint64_t> & hashes = seq.block_hashes;
    if (num_keyable <= (int64_t) hashes.size()) return;
    uint64_t parent = hashes.empty() ? root_key(seq.adapter_uid) : hashes.back();
    for (int64_t i = (int64_t) hashes.size(); i < num_keyable; ++i) {
        const int32_t * tokens = seq.token_ids.data() + i * block_size_;
        const uint64_t key = key_of(parent, tokens);
        hashes.push_back(key);
        const int32_t b = seq.block_ids[i];
        if (b != kReleased && !has_key_[b] && key_to_block_.find(key) == key_to_block_.end()) {
            key_to_block_.emplace(key, b);
            has_key_[b] = 1;
            block_key_[b] = key;
            block_parent_[b] = parent;
            std::memcpy(&block_tokens_[(size_t) b * block_size_], tokens, sizeof(int32_t) * block_size_);
        }
        // else: the same content was computed into another block at the same time (that one stays
        // the entry), or a colliding key holds the entry
        parent = key;
    }
}

// ---- internals

int32_t BlockManager::take_block() {
    int32_t b;
    if (!free_.empty()) {
        b = free_.front();
        free_.pop_front();
    } else {
        b = lru_next_[num_blocks_];  // least recently freed
        lru_remove(b);
        key_to_block_.erase(block_key_[b]);
        has_key_[b] = 0;
        block_key_[b] = 0;
        block_parent_[b] = 0;
    }
    ref_counts_[b] = 1;
    return b;
}

std::string BlockManager::check_invariants(const std::vector<const BlockSequence *> * seqs) const {
    auto fail = [](int32_t b, const std::string & what) { return "block " + std::to_string(b) + " " + what; };
    std::vector<uint8_t> in_free(num_blocks_, 0);
    for (int32_t b : free_) {
        if (b < 0 || b >= num_blocks_) return "free list holds an id out of range: " + std::to_string(b);
        if (in_free[b]++) return fail(b, "is twice in the free list");
    }
    int32_t lru_len = 0;
    for (int32_t b = lru_next_[num_blocks_]; b != num_blocks_; b = lru_next_[b]) {
        if (++lru_len > num_blocks_) return "the cached list has a cycle";
        if (!in_lru_[b]) return fail(b, "is in the cached list but not marked cached");
        if (lru_prev_[lru_next_[b]] != b) return fail(b, "has a broken link in the cached list");
    }
    if (lru_len != num_cached_) return "the cached list holds " + std::to_string(lru_len) + " blocks, counted " +
                                      std::to_string(num_cached_);
    int32_t num_keyed = 0;
    for (int32_t b = 0; b < num_blocks_; ++b) {
        const int32_t rc = ref_counts_[b];
        if (rc < 0) return fail(b, "has ref count " + std::to_string(rc));
        const int states = (in_free[b] != 0) + (in_lru_[b] != 0) + (rc > 0);
        if (states != 1) return fail(b, "is in " + std::to_string(states) + " states (ref count " +
                                            std::to_string(rc) + ")");
        if (in_free[b] && has_key_[b]) return fail(b, "is free but still has a prefix key");
        if (in_lru_[b] && !has_key_[b]) return fail(b, "is cached but has no prefix key");
        if (has_key_[b]) {
            ++num_keyed;
            auto it = key_to_block_.find(block_key_[b]);
            if (it == key_to_block_.end() || it->second != b) return fail(b, "key is not mapped back to it");
        }
    }
    if ((int32_t) key_to_block_.size() != num_keyed) return "the key map and the keyed blocks differ in number";
    if (num_free_blocks() + num_cached_blocks() + num_used_blocks() != num_blocks_) return "free + cached + used != total";
    if (seqs) {
        std::vector<int32_t> held(num_blocks_, 0);
        for (const BlockSequence * s : *seqs) {
            bool held_one = false;
            for (int32_t b : s->block_ids) {
                if (b == kReleased) {
                    if (held_one) return "a sequence's released blocks are not a prefix of its blocks";
                    continue;
                }
                held_one = true;
                if (b < 0 || b >= num_blocks_) return "a sequence holds an id out of range: " + std::to_string(b);
                ++held[b];
            }
        }
        for (int32_t b = 0; b < num_blocks_; ++b) {
            if (held[b] != ref_counts_[b]) return fail(b, "is held " + std::to_string(held[b]) +
                                                       " times but has ref count " + std::to_string(ref_counts_[b]));
        }
    }
    return "";
}

}  // namespace turbomind
