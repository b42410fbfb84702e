// The shift_one peer schedule of decentralized SGD (algorithms/parts/peers.py): pairs from a round-robin
// schedule that rotates with each exchange. For odd P one rank sits each exchange out, so every P
// exchanges everyone has met everyone. The exchange itself runs in Python over torch.distributed.
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

}  // namespace collectives
}  // namespace bagua_lite
