// Decentralized averaging of a weight tensor with peers (D-PSGD's gossip step).
//   ring:      t <- (t_left + t + t_right) / 3 (for P = 2 the single neighbour: (t + t_other) / 2)
//   shift_one: pairs from a round-robin schedule that rotates with `step`; t <- (t + t_partner) / 2.
//              For odd P one rank sits each step out, so every P steps everyone has met everyone.
//   all:       t <- mean over all ranks (an allreduce).
#include "collectives/collectives.h"

namespace bagua_lite {
namespace collectives {

int64_t shift_one_partner(int64_t rank, int64_t size, int64_t step) {
  // Circle method over n = size rounded up to even players; player n-1 stays put, the others rotate.
  const int64_t n = size + (size % 2), m = n - 1, r = step % m;
  int64_t partner;
  if (rank == n - 1) {
    partner = r;
  } else {
    partner = ((2 * r - rank) % m + m) % m;
    if (partner == rank) partner = n - 1;
  }
  return partner >= size ? -1 : partner;  // the extra player of odd sizes is a bye
}

void peer_average(const ProcessGroupPtr& pg, at::Tensor& t, const std::string& mode, int64_t step) {
  check_contiguous(t, "peer_average", "t");
  check_floating(t, "peer_average", "t");
  BL_CHECK(mode == "ring" || mode == "shift_one" || mode == "all", "peer_average: unknown mode '", mode,
           "'; allowed: 'ring', 'shift_one', 'all'");
  BL_CHECK(step >= 0, "peer_average: step must be >= 0, got ", step);
  const int64_t P = pg->getSize(), me = pg->getRank();
  if (P == 1 || t.numel() == 0) return;

  if (mode == "all") {
    pg_allreduce_sum(pg, t);
    t.div_(P);
    return;
  }
  const int64_t bytes = t.nbytes();
  auto flat = t.view(-1);
  auto as_like = [&](at::Tensor raw) { return raw.view(t.scalar_type()); };

  if (mode == "shift_one" || P == 2) {
    const int64_t peer = mode == "shift_one" ? shift_one_partner(me, P, step) : 1 - me;
    if (peer < 0) return;
    auto other = as_like(scratch_bytes(Slot::kRecv, bytes, t.device()));
    pg_exchange(pg, flat, other, peer, 0);
    flat.add_(other).mul_(0.5);  // t_a + t_b == t_b + t_a: both partners get the same bits
    return;
  }

  // ring with P >= 3: send to both neighbours, receive from both, then average.
  const int64_t left = (me + P - 1) % P, right = (me + 1) % P;
  auto from_left = as_like(scratch_bytes(Slot::kRecv, bytes, t.device()));
  auto from_right = as_like(scratch_bytes(Slot::kAux, bytes, t.device()));
  std::vector<at::Tensor> s{flat}, rl{from_left}, rr{from_right};
  // Tag 0 travels rightwards, tag 1 leftwards, so the two messages between a pair never mix.
  auto w1 = pg->send(s, static_cast<int>(right), 0);
  auto w2 = pg->send(s, static_cast<int>(left), 1);
  auto w3 = pg->recv(rl, static_cast<int>(left), 0);
  auto w4 = pg->recv(rr, static_cast<int>(right), 1);
  wait(w1);
  wait(w2);
  wait(w3);
  wait(w4);
  count_sent(2 * bytes, 2);
  flat.add_(from_left).add_(from_right).div_(3);
}

}  // namespace collectives
}  // namespace bagua_lite
