// ---- lily qgemv helpers, routing part (after qgemv_common): moe_router_topk and
// moe_gate_up pull it in with a `// @header` line ----
// Routing of one row by one simdgroup (all 32 lanes call it): fp32 softmax over the E
// logits lg[0..E) (already rounded to T), probabilities rounded to T, K rounds of a
// lane-parallel argmax with ties to the lowest expert id (picks in decreasing order),
// and with NORM the picks divided by their sum rounded to T. Lane j < K gets pick j in
// (idx, score); other lanes get (0, 0). Ids are always in [0, E): a NaN probability
// ranks below every number and its pick scores NaN.
template <typename T, int E, int K, bool NORM, typename LP>
inline void lily_route_topk(LP lg, int lane, thread uint& idx, thread float& score) {
  constexpr int EPL = (E + 31) / 32;
  float p[EPL];
  float m = -INFINITY;
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? static_cast<float>(lg[e]) : -INFINITY;
    m = max(m, p[i]);
  }
  for (ushort o = 16; o > 0; o >>= 1) {
    m = max(m, simd_shuffle_xor(m, o));
  }
  float den = 0.0f;
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? metal::exp(p[i] - m) : 0.0f;
    den += p[i];
  }
  den = lily_group_sum<32>(den);
  const float inv = 1.0f / den;
  for (int i = 0; i < EPL; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? lily_round<T>(p[i] * inv) : -1.0f;
    // NaN (tested on the bits, which fast math cannot fold): picked after every number,
    // scored NaN
    if (e < E && (as_type<uint>(p[i]) & 0x7fffffffu) > 0x7f800000u) {
      p[i] = -0.5f;
    }
  }
  uint my_i = 0u;
  float my_v = 0.0f;
  for (int j = 0; j < K; ++j) {
    float bv = -2.0f;
    int bi = 0x7fffffff;
    for (int i = 0; i < EPL; ++i) {
      if (p[i] > bv) {
        bv = p[i];
        bi = lane + 32 * i;
      }
    }
    for (ushort o = 16; o > 0; o >>= 1) {
      const float ov = simd_shuffle_xor(bv, o);
      const int oi = simd_shuffle_xor(bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {
        bv = ov;
        bi = oi;
      }
    }
    for (int i = 0; i < EPL; ++i) {
      if (lane + 32 * i == bi) {
        p[i] = -3.0f;
      }
    }
    if (lane == j) {
      my_i = uint(bi);
      my_v = bv < 0.0f ? NAN : bv;
    }
  }
  const float tot = lily_group_sum<32>(lane < K ? my_v : 0.0f);
  idx = my_i;
  score = lane < K ? (NORM ? my_v / lily_round<T>(tot) : my_v) : 0.0f;
}
