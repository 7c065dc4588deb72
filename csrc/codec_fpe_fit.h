// The fpe table fitted on the device: the tensor's symbol counts
// (buddy.codecs.fpe.symbol_counts) and buddy.codecs.fpe.Table.from_counts --
// the same table, byte for byte -- by one warp, so a compress with nothing
// learned needs no read of the tensor's symbol counts (the kernels' table and
// the serialized table come back with the size histogram, in the one read a
// compress makes). Host-compilable: tests/host/codec_host.cpp runs it under
// the emulated warp and the tests compare it with the reference on many count
// vectors.
//
// The reference, step by step (buddy/codecs/fpe.py, Table.from_counts and
// _huffman_lengths), and how the warp does each:
//   scale    c = max(1, round(count * 2^30 / total)) for count > 0, else 0
//            (double; round half to even: rint). Exact: counts are integers
//            below 2^53, so the total is exact in any order of summation.
//   coded    the MAX_CODED regular symbols of largest (c, -symbol); the
//            others' c summed is ESC's weight (at least 1). The 255th largest
//            key c << 12 | (4095 - symbol) is found by a radix select, a
//            4-bit digit at a time from the top (11 passes, each lane
//            counting its keys' digits in packed counters, then 8 warp sums),
//            when more than 255 regular symbols occur.
//   leaves   coded symbols, ZERO (when c > 0) and ESC, sorted by (weight,
//            symbol): each lane ranks its leaves against all the others.
//   lengths  Huffman by two queues -- leaves in sorted order, merged nodes in
//            creation order, a leaf first on equal weights -- which pops what
//            the reference's heap pops; a leaf's length is its depth. While
//            the longest code passes MAX_CODE_BITS the reference halves every
//            weight (max(1, w >> 1)) and starts again: after t rounds the
//            weights are max(1, w >> t). Lane t builds the tree of round t at
//            once (t = 0..31: at t = 31 every weight is 1, so the longest code
//            is 9 bits and lane 31 always fits) and keeps only its height; a
//            tree's shape does not depend on how leaves of equal weight are
//            ordered, so the lanes share one order. The first t that fits is
//            the reference's; lane 0 then builds that tree again with the
//            leaves in the reference's order (ties by symbol) and reads every
//            leaf's depth.
//   codes    canonical: the leaves ranked by (length, symbol); a code is the
//            Kraft sum of the codes before it (a warp scan) at its length.
// Cost: two serial passes of at most 256 merges (the 32 round trees side by
// side, then lane 0 alone), O(L^2 / 32) compares per ranking (L <= 257
// leaves: three rankings) and, when more than 255 symbols occur, 11 passes
// of S / 32 keys per lane for the radix select (S = 4096 for the 12-bit
// symbols: about 1400 a lane) -- about 130,000 warp instructions
// (python -m experiments.lab.kernel_budget, docs/kernel_budget.md), not measured
// on a GPU; the kernel runs once per compress that has no learned table.
#pragma once

#include "buddy_warp.h"
#include "codec_fpe.h"

#if defined(BUDDY_NATIVE_SOLO)
#include <algorithm>
#include <functional>
#endif

#define BUDDY_FPE_MAX_CODED 255u                            // regular symbols with codes at most (fpe.MAX_CODED)
#define BUDDY_FPE_MAX_LEAVES (BUDDY_FPE_MAX_CODED + 2u)      // and ZERO and ESC
#define BUDDY_FPE_SERIAL_BYTES (4u + 3u * BUDDY_FPE_MAX_LEAVES)  // the longest serialized table: 775 bytes
// the leaves a lane of a warp ranks (9)
#define BUDDY_FIT_PER_LANE ((BUDDY_FPE_MAX_LEAVES + BUDDY_WARP_SIZE - 1u) / BUDDY_WARP_SIZE)
#define BUDDY_FPE_TABLE_FORMAT 3u                            // byte 0 of a fitted table (fpe.TABLE_FORMAT)

#define BUDDY_FPE_FIT_LANES 32u  // the fit is a warp of 32 lanes: lane t builds the tree of round t (below)

// Scratch of one fit (buddy.engines.cuda.FIT_WORK_BYTES), in global memory.
struct BuddyFpeFitWork {
  uint64_t node[(BUDDY_FPE_MAX_LEAVES - 1u) * BUDDY_FPE_FIT_LANES];  // lane t's merged nodes: weight | height << 40
  uint64_t part[BUDDY_FPE_FIT_LANES];                                // a 64-bit warp sum's lane partials
  uint32_t c[BUDDY_FPE_SYMBOLS];                                 // scaled counts
  uint32_t leaf_w[BUDDY_FPE_MAX_LEAVES], leaf_s[BUDDY_FPE_MAX_LEAVES];  // the leaves, by symbol
  uint32_t w[BUDDY_FPE_MAX_LEAVES], s[BUDDY_FPE_MAX_LEAVES];            // the leaves sorted (weight, symbol)
  uint32_t len[BUDDY_FPE_MAX_LEAVES];                                    // code length per sorted leaf
  uint32_t parent[2u * BUDDY_FPE_MAX_LEAVES], depth[2u * BUDDY_FPE_MAX_LEAVES];
  uint32_t canon_s[BUDDY_FPE_MAX_LEAVES], canon_len[BUDDY_FPE_MAX_LEAVES];  // canonical order
};
#define BUDDY_FPE_FIT_WORK_BYTES 93496u  // buddy.engines.cuda.FIT_WORK_BYTES
static_assert(sizeof(BuddyFpeFitWork) == BUDDY_FPE_FIT_WORK_BYTES, "the loader allocates this many bytes");

// Counting, in the symbols of the tables a fit makes (table format 3,
// buddy_fpe_fit_split), into counts (S + 2 uint32: a block's shared counts).
// A word's key: its symbol, ZERO for an all-zero word.
template <int WB>
BUDDY_HD uint32_t buddy_fpe_count_key(typename BuddyFpe<WB>::word_t x) {
  constexpr uint32_t t = buddy_fpe_fit_split<WB>::t, zero = 1u << buddy_fpe_fit_split<WB>::b;
  if constexpr (BUDDY_WARP_SIZE == 1) {  // a mask, not a branch half-zero activations mispredict (buddy_warp.h)
    const uint32_t z = 0u - (uint32_t)(x == 0);
    return (zero & z) | ((uint32_t)((uint64_t)x >> t) & (zero - 1u) & ~z);
  }
  return x == 0 ? zero : (uint32_t)((uint64_t)x >> t) & (zero - 1u);
}

#define BUDDY_FPE_KEY_BITS 13u           // a key is below 2^13 (ZERO = 4096 at most)
#define BUDDY_FPE_NO_KEY 0x1FFFu         // the key of a lane with no word: never counted

// The words of each lane's 16-byte unit (valid: the lane has one) counted by
// the warp, aggregated: per word position, the lanes with equal keys add
// their number once (buddy_warp_match), so the common keys -- ZERO is about
// half of a ReLU's words -- cost one atomic a warp, not one a lane. (A warp of one lane has no peers: its
// block counts in buddy_count_body, buddy_kernels.cu.)
template <int WB, class Warp>
BUDDY_WARP_FN void buddy_fpe_count_unit16(const Warp& warp, buddy_u128 unit, bool valid, uint32_t* counts) {
  const uint32_t below = (1u << warp.lane()) - 1u;  // the lanes before this one: a lane adds for its peers where
                                                    // none of them is before it (one AND, not a count of zeros)
  for (uint32_t i = 0; i < 16u / WB; ++i) {
    const uint32_t key = valid ? buddy_fpe_count_key<WB>(BuddyFpe<WB>::unit_word(unit, i)) : BUDDY_FPE_NO_KEY;
    const uint32_t peers = buddy_warp_match(warp, key, BUDDY_FPE_KEY_BITS);
    if (key != BUDDY_FPE_NO_KEY && (peers & below) == 0u) buddy_atomic_add(&counts[key], buddy_popc(peers));
  }
}

// The same count without matching keys (the count kernel's `aggregate` 0): per word position, the zero words
// by a ballot, their number added to *zeros (the same on every lane: the warp's), and every other word by an atomic
// add of its own -- lanes of equal keys meet at one count, which the hardware serializes. The matched count's
// warps spend most of their cycles waiting on shared memory (the profile in docs/kernel_budget.md); this form, a
// ballot where the match was, is there for a GPU to time beside it.
template <int WB, class Warp>
BUDDY_WARP_FN void buddy_fpe_count_unit16_ballot(const Warp& warp, buddy_u128 unit, bool valid, uint32_t* counts,
                                                 uint32_t* zeros) {
  for (uint32_t i = 0; i < 16u / WB; ++i) {
    const typename BuddyFpe<WB>::word_t x = BuddyFpe<WB>::unit_word(unit, i);
    const bool zero = x == 0;
    *zeros += buddy_popc(warp.ballot(valid && zero));
    if (valid && !zero) buddy_atomic_add(&counts[buddy_fpe_count_key<WB>(x)], 1u);
  }
}

// One word (a lane alone: the tensor's odd 8 bytes and its last, partial entry).
template <int WB>
BUDDY_HD void buddy_fpe_count_word(const uint8_t* p, uint32_t* counts) {
  buddy_atomic_add(&counts[buddy_fpe_count_key<WB>(buddy_load<typename BuddyFpe<WB>::word_t>(p))], 1u);
}

// Sum over the warp of a 64-bit value, on every lane.
template <class Warp>
BUDDY_WARP_FN uint64_t buddy_fit_sum64(const Warp& warp, uint64_t* part, uint64_t v) {
  part[warp.lane()] = v;
  warp.sync();
  uint64_t sum = 0;
  for (uint32_t l = 0; l < BUDDY_WARP_SIZE; ++l) sum += part[l];
  warp.sync();  // every lane has read the partials before they are written again
  return sum;
}

// Ranks the n leaves (weight max(1, from_w >> t), symbol from_s) by (weight,
// symbol) and writes them in that order to to_w (the shifted weights) and to_s.
template <class Warp>
BUDDY_WARP_FN void buddy_fit_sort(const Warp& warp, const uint32_t* from_w, const uint32_t* from_s, uint32_t n,
                                  uint32_t t, uint32_t* to_w, uint32_t* to_s) {
#if defined(BUDDY_NATIVE_SOLO)
  // one lane: the keys sorted (distinct: the symbols are), the same order as the ranks (a lane's ranks are O(n^2))
  uint64_t keys[BUDDY_FPE_MAX_LEAVES];
  for (uint32_t i = 0; i < n; ++i) keys[i] = (uint64_t)buddy_max(1u, from_w[i] >> t) << 13 | from_s[i];
  std::sort(keys, keys + n);
  for (uint32_t r = 0; r < n; ++r) {
    to_w[r] = (uint32_t)(keys[r] >> 13);
    to_s[r] = (uint32_t)(keys[r] & 0x1FFFu);
  }
#else
  // a lane ranks its leaves i = lane + 32 k in one pass over the leaves j, their keys in registers: each leaf's
  // key read once a lane, not once for every leaf ranked (2 x 257 loads a lane, where 2 x 9 x 257 were)
  uint64_t mine[BUDDY_FIT_PER_LANE];
  uint32_t rank[BUDDY_FIT_PER_LANE];
  for (uint32_t k = 0; k < BUDDY_FIT_PER_LANE; ++k) {
    const uint32_t i = warp.lane() + BUDDY_WARP_SIZE * k;
    mine[k] = i < n ? (uint64_t)buddy_max(1u, from_w[i] >> t) << 13 | from_s[i] : ~(uint64_t)0;
    rank[k] = 0;
  }
  for (uint32_t j = 0; j < n; ++j) {
    const uint64_t key = (uint64_t)buddy_max(1u, from_w[j] >> t) << 13 | from_s[j];
    for (uint32_t k = 0; k < BUDDY_FIT_PER_LANE; ++k) rank[k] += key < mine[k];
  }
  for (uint32_t k = 0; k < BUDDY_FIT_PER_LANE; ++k) {
    const uint32_t i = warp.lane() + BUDDY_WARP_SIZE * k;
    if (i < n) {
      to_w[rank[k]] = (uint32_t)(mine[k] >> 13);
      to_s[rank[k]] = (uint32_t)(mine[k] & 0x1FFFu);
    }
  }
#endif
  warp.sync();
}

// The two queues of a Huffman build: each pick takes the next leaf (weights
// sorted) unless the oldest unmerged node is lighter.
struct BuddyFitQueues {
  uint32_t leaf, node, made;  // next leaf, next unmerged node, nodes made
};

// The height of the tree over the n sorted weights max(1, w >> t); node: this
// lane's merged nodes, stride apart.
BUDDY_HD uint32_t buddy_fit_height(const uint32_t* w, uint32_t n, uint32_t t, uint64_t* node, uint32_t stride) {
  BuddyFitQueues q = {0, 0, 0};
  for (uint32_t m = 0; m + 1 < n; ++m) {
    uint64_t sum = 0, height = 0;
    for (int pick = 0; pick < 2; ++pick) {
      uint64_t pw, ph;
      const bool leaf = q.leaf < n && (q.node >= q.made || buddy_max(1u, w[q.leaf] >> t) <= (node[q.node * stride] & 0xFFFFFFFFFFull));
      if (leaf) {
        pw = buddy_max(1u, w[q.leaf++] >> t);
        ph = 0;
      } else {
        pw = node[q.node * stride] & 0xFFFFFFFFFFull;
        ph = node[q.node++ * stride] >> 40;
      }
      sum += pw;
      height = buddy_max(height, ph + 1u);
    }
    node[q.made++ * stride] = sum | height << 40;
  }
  return n > 1 ? (uint32_t)(node[(n - 2) * stride] >> 40) : 1u;
}

// The code lengths of the sorted leaves (weights w, already shifted) into len:
// each leaf's depth in the two-queue tree (lane 0 alone; 1 for a single leaf).
BUDDY_HD void buddy_fit_lengths(BuddyFpeFitWork* wk, uint32_t n) {
  if (n == 1) {
    wk->len[0] = 1;
    return;
  }
  uint64_t* node = wk->node;  // lane 0's column, contiguous here: ids n, n + 1, ... are nodes 0, 1, ...
  BuddyFitQueues q = {0, 0, 0};
  for (uint32_t m = 0; m + 1 < n; ++m) {
    uint64_t sum = 0;
    for (int pick = 0; pick < 2; ++pick) {
      const bool leaf = q.leaf < n && (q.node >= q.made || wk->w[q.leaf] <= node[q.node]);
      const uint32_t id = leaf ? q.leaf : n + q.node;
      sum += leaf ? wk->w[q.leaf++] : node[q.node++];
      wk->parent[id] = n + q.made;
    }
    node[q.made++] = sum;
  }
  const uint32_t root = 2u * n - 2u;
  wk->depth[root] = 0;
  for (uint32_t x = root; x-- > 0;) wk->depth[x] = wk->depth[wk->parent[x]] + 1u;
  for (uint32_t i = 0; i < n; ++i) wk->len[i] = wk->depth[i];
}

// The r-th largest (r >= 1) of the keys c[i] << 12 | (4095 - i) of the symbols i < S with c[i] > 0 (c < 2^31,
// S <= 4096: distinct keys below 2^44; at least r of them), on every lane: a radix select, a 4-bit digit at a
// time from the top. Per digit each lane counts the digits of the keys that share the digits found so far, 16
// counters of 8 bits in two words (a lane has at most S / 32 = 128 symbols), and the warp adds them up, 16
// bits a counter (at most S); the digit is the one at which the count from 15 down reaches r.
//
// Once at most 32 keys share the digits found (`part`: 32 words of scratch), they are gathered one a lane and
// ranked among themselves: the passes over every symbol stop there (on the capture workloads' counts after 5.2 of
// the 11 digits on average, about 20 keys left: experiments.lab.kernel_budget, `select_passes`).
template <class Warp>
BUDDY_WARP_FN uint64_t buddy_fit_select(const Warp& warp, const uint32_t* c, uint32_t S, uint32_t r, uint64_t* part) {
#if defined(BUDDY_NATIVE_SOLO)
  // one lane (whose counters of 8 bits the 4,096 symbols would overflow): the r-th largest key by a partial sort
  (void)warp;
  (void)part;
  uint64_t keys[BUDDY_FPE_SYMBOLS];
  uint32_t m = 0;
  for (uint32_t i = 0; i < S; ++i)
    if (c[i]) keys[m++] = (uint64_t)c[i] << 12 | (4095u - i);
  std::nth_element(keys, keys + (r - 1u), keys + m, std::greater<uint64_t>());
  return keys[r - 1u];
#else
  uint64_t found = 0;  // the digits above `shift` found so far
  for (int shift = 40; shift >= 0; shift -= 4) {
    uint64_t lo = 0, hi = 0;  // digits 0-7 and 8-15, 8 bits each
    for (uint32_t i = warp.lane(); i < S; i += BUDDY_WARP_SIZE) {
      const uint64_t key = (uint64_t)c[i] << 12 | (4095u - i);
      const bool in = c[i] && (key >> (shift + 4)) == (found >> (shift + 4));
      const uint32_t d = (uint32_t)(key >> shift) & 15u;
      const uint64_t one = in ? (uint64_t)1 << (8u * (d & 7u)) : 0u;
      lo += d < 8u ? one : 0u;
      hi += d < 8u ? 0u : one;
    }
    // the warp's counts, two 16-bit counters a 32-bit sum: even digits of a word, then odd ones
    uint32_t count[16];
    for (uint32_t half = 0; half < 2; ++half) {
      const uint64_t h = half ? hi : lo;
      const uint64_t even = h & 0x00FF00FF00FF00FFull, odd = (h >> 8) & 0x00FF00FF00FF00FFull;
      for (uint32_t w = 0; w < 2; ++w) {
        const uint32_t e = buddy_warp_sum(warp, (uint32_t)(even >> (32u * w)));
        const uint32_t o = buddy_warp_sum(warp, (uint32_t)(odd >> (32u * w)));
        count[8u * half + 4u * w + 0u] = e & 0xFFFFu;
        count[8u * half + 4u * w + 1u] = o & 0xFFFFu;
        count[8u * half + 4u * w + 2u] = e >> 16;
        count[8u * half + 4u * w + 3u] = o >> 16;
      }
    }
    uint32_t above = 0, digit = 0;
    for (uint32_t d = 16; d-- > 0;) {
      if (above + count[d] >= r) {
        digit = d;
        break;
      }
      above += count[d];
    }
    r -= above;
    found |= (uint64_t)digit << shift;
    if (shift > 0 && count[digit] <= BUDDY_WARP_SIZE) {  // the few keys with these digits, ranked directly
      const uint32_t lane = warp.lane(), few = count[digit];
      uint32_t have = 0;
      for (uint32_t base = 0; base < S; base += BUDDY_WARP_SIZE) {
        const uint32_t i = base + lane;
        const uint64_t key = i < S ? (uint64_t)c[i] << 12 | (4095u - i) : 0u;
        const bool in = i < S && c[i] && (key >> shift) == (found >> shift);
        const uint32_t ballot = warp.ballot(in);
        if (in) part[have + buddy_popc(ballot & ((1u << lane) - 1u))] = key;
        have += buddy_popc(ballot);
      }
      warp.sync();
      const uint64_t mine = lane < few ? part[lane] : 0u;
      uint32_t above_mine = 0;  // (the keys are distinct)
      for (uint32_t j = 0; j < few; ++j) above_mine += part[j] > mine;
      const uint32_t at = buddy_ctz(warp.ballot(lane < few && above_mine == r - 1u));
      const uint64_t kth = part[at];
      warp.sync();  // every lane has read the keys before part is written again
      return kth;
    }
  }
  return found;
#endif
}

// Fits the fpe table of word size word_bytes to counts (S + 2 int64: the
// regular symbols, ZERO, ESC (only in the total); non-negative) as Table.from_counts
// does: a table of format 3 (S = 2^12; 2^8 for 1-byte words). Writes the
// kernels' device table (every byte: its multi rows and span model too) and
// the serialized table (fpe.Table.to_bytes; BUDDY_FPE_SERIAL_BYTES bytes,
// zeros after it). weighted: the counts are the weights the reference's scale
// makes of them (fpe.fit_weights: each below 2^31, ESC's not read), taken as
// they are -- how a learned prior, frequencies rather than counts, is fitted.
template <class Warp>
BUDDY_WARP_FN void buddy_fpe_fit(const Warp& warp, const int64_t* counts, uint32_t word_bytes, bool weighted,
                                 BuddyFpeFitWork* wk, BuddyFpeTable* table, uint8_t* serial) {
  static_assert(sizeof(Warp) > 0 && (BUDDY_WARP_SIZE == BUDDY_FPE_FIT_LANES || BUDDY_WARP_SIZE == 1),
                "the fit runs 32 lanes a warp (or one, on the host)");
  const uint32_t lane = warp.lane();
  const uint32_t b = word_bytes == 1 ? buddy_fpe_fit_split<1>::b : buddy_fpe_fit_split<2>::b;
  const uint32_t S = 1u << b, ZERO = S, ESC = S + 1u;

  // scale the counts to integers summing to about 2^30 (weights: as they are)
  uint64_t mine = 0;
  for (uint32_t i = lane; !weighted && i < S + 2u; i += BUDDY_WARP_SIZE) mine += (uint64_t)counts[i];  // ESC's too
  const uint64_t total = weighted ? 0u : buddy_fit_sum64(warp, wk->part, mine);
  const double scale = total > 0 ? 1073741824.0 / (double)total : 1.0;
  uint32_t nonzero = 0;
  for (uint32_t i = lane; i < S + 1u; i += BUDDY_WARP_SIZE) {
    const int64_t v = counts[i];
    wk->c[i] = v <= 0 ? 0u : weighted ? (uint32_t)v : buddy_max(1u, (uint32_t)buddy_rint((double)v * scale));
    nonzero += i < S && v > 0;
  }
  nonzero = buddy_warp_sum(warp, nonzero);
  warp.sync();

  // which regular symbols get codes: all, or the 255 of largest key c << 12 | (4095 - symbol) (distinct keys
  // below 2^44): the threshold is the 255th largest key, found a 4-bit digit at a time from the top
  uint64_t threshold = 0;
  if (nonzero > BUDDY_FPE_MAX_CODED) threshold = buddy_fit_select(warp, wk->c, S, BUDDY_FPE_MAX_CODED, wk->part);
  // the leaves in symbol order (a ballot per 32 symbols), the others' weight for ESC
  uint32_t n = 0, rest = 0;
  for (uint32_t base = 0; base < S; base += BUDDY_WARP_SIZE) {
    const uint32_t i = base + lane;
    const uint32_t c = i < S ? wk->c[i] : 0u;
    const bool coded = c && ((uint64_t)c << 12 | (4095u - i)) >= threshold;
    rest += c && !coded ? c : 0u;
    const uint32_t ballot = warp.ballot(coded);
    if (coded) {
      const uint32_t at = n + buddy_popc(ballot & ((1u << lane) - 1u));
      wk->leaf_w[at] = c;
      wk->leaf_s[at] = i;
    }
    n += buddy_popc(ballot);
  }
  rest = buddy_warp_sum(warp, rest);
  const uint32_t zero = wk->c[ZERO] ? 1u : 0u;
  if (lane == 0) {
    if (zero) {
      wk->leaf_w[n] = wk->c[ZERO];
      wk->leaf_s[n] = ZERO;
    }
    wk->leaf_w[n + zero] = buddy_max(1u, rest);
    wk->leaf_s[n + zero] = ESC;
  }
  n += zero + 1u;
  warp.sync();

  // the first round of halving whose longest code fits: lane t tries round t
  buddy_fit_sort(warp, wk->leaf_w, wk->leaf_s, n, 0u, wk->w, wk->s);
#if BUDDY_WARP_SIZE == 1
  uint32_t t = 0;  // one lane: the rounds in turn, up to the first that fits (the 32 lanes' lowest)
  while (t + 1u < BUDDY_FPE_FIT_LANES && buddy_fit_height(wk->w, n, t, wk->node, 1u) > BUDDY_FPE_CODE_BITS) ++t;
#else
  const uint32_t height = buddy_fit_height(wk->w, n, lane, wk->node + lane, BUDDY_WARP_SIZE);
  const uint32_t t = buddy_ctz64(warp.ballot(height <= BUDDY_FPE_CODE_BITS));
#endif
  warp.sync();
  // that round's tree with the leaves in the reference's order: every leaf's length
  buddy_fit_sort(warp, wk->leaf_w, wk->leaf_s, n, t, wk->w, wk->s);
  if (lane == 0) buddy_fit_lengths(wk, n);
  // meanwhile the table is cleared: a row or symbol no code reaches reads 0
  for (uint32_t v = lane; v < BUDDY_FPE_ROWS; v += BUDDY_WARP_SIZE) table->dec[v] = 0;
  for (uint32_t i = lane; i < BUDDY_FPE_SYMBOLS; i += BUDDY_WARP_SIZE) table->enc[i] = 0;
  for (uint32_t i = lane; i < BUDDY_FPE_SERIAL_BYTES; i += BUDDY_WARP_SIZE) serial[i] = 0;
  warp.sync();

  // canonical order: by (length, symbol), ranked as the leaves are (a code's length is at least 1: its own key)
  buddy_fit_sort(warp, wk->len, wk->s, n, 0u, wk->canon_len, wk->canon_s);
  // codes: the Kraft sum before each, at its length; written most significant bit first
  uint32_t kraft = 0, model_num = 0, model_den = 0;  // the span model's sums (fpe.Table.span_model)
  for (uint32_t base = 0; base < n; base += BUDDY_WARP_SIZE) {
    const uint32_t i = base + lane;
    const uint32_t len = i < n ? wk->canon_len[i] : BUDDY_FPE_CODE_BITS;
    uint32_t sum;
    const uint32_t before = kraft + buddy_warp_exclusive_scan(warp, i < n ? 1u << (BUDDY_FPE_CODE_BITS - len) : 0u, &sum);
    kraft += sum;
    if (i < n) {
      const uint32_t sym = wk->canon_s[i], code = before >> (BUDDY_FPE_CODE_BITS - len);
      uint32_t stream = 0;  // the code bit-reversed: its first bit is the stream's bit 0
      for (uint32_t bit = 0; bit < len; ++bit) stream |= (code >> (len - 1u - bit) & 1u) << bit;
      table->enc[sym] = (uint16_t)(stream | len << 12);
      for (uint32_t v = stream; v < BUDDY_FPE_ROWS; v += 1u << len) table->dec[v] = sym | len << 16;
      serial[4u + 3u * i] = (uint8_t)(sym & 0xFFu);
      serial[5u + 3u * i] = (uint8_t)(sym >> 8);
      serial[6u + 3u * i] = (uint8_t)len;
      if (sym != ZERO) {
        model_num += (1u << (BUDDY_FPE_CODE_BITS - len)) * (len + (sym == ESC ? b : 0u));
        model_den += 1u << (BUDDY_FPE_CODE_BITS - len);
      }
    }
  }
  model_num = buddy_warp_sum(warp, model_num);
  model_den = buddy_warp_sum(warp, model_den);  // > 0: ESC always has a code
  warp.sync();  // every lane's decode rows and encode entries are written before any lane reads them
  // the multi rows, from the decode rows (fpe.Table.multi_rows)
  for (uint32_t v = lane; v < BUDDY_FPE_ROWS; v += BUDDY_WARP_SIZE) {
    uint32_t pos = 0, starts = 0, tails = 0;
    while (pos < BUDDY_FPE_CODE_BITS) {
      const uint32_t row = table->dec[v >> pos], len = row >> 16, sym = row & 0xFFFFu;
      if (len == 0 || sym == ESC || pos + len > BUDDY_FPE_CODE_BITS) break;
      starts |= 1u << pos;
      tails |= (uint32_t)(sym != ZERO) << pos;
      pos += len;
    }
    table->multi[v] = starts | tails << 12 | pos << 24;
  }
  if (lane == 0) {
    table->sym_bits = b;
    table->split = 1;
    table->span_model = (table->enc[ZERO] >> 12) | (uint32_t)((uint64_t)model_num * 256u / model_den) << 8;
    serial[0] = BUDDY_FPE_TABLE_FORMAT;
    serial[1] = (uint8_t)word_bytes;
    serial[2] = (uint8_t)(n & 0xFFu);
    serial[3] = (uint8_t)(n >> 8);
  }
}
