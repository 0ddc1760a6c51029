// Executes the schedule's lists on the send/recv model of check.h and reports the first problem.
#include "pipeline/check.h"

#include <vector>

#include "core/status.h"

namespace zt {

namespace {

using detail::concat;

struct StageState {
  size_t pos = 0;
  bool send_posted = false;  // rendezvous: the send at pos is posted, waiting for its recv
  size_t send_slot = 0;      // its index in the channel
  // Indexed by micro * V + chunk.
  std::vector<char> f, b, w, bw, got_act, got_grad;
};

struct Checker {
  const Schedule& S;
  CommModel model;
  int P, m, V;
  std::vector<StageState> st;
  // chan[a * P + b]: sends posted a -> b (stage, action index), and how many b has received.
  std::vector<std::vector<std::pair<int, size_t>>> chan;
  std::vector<size_t> taken;

  Checker(const Schedule& s, CommModel cm)
      : S(s),
        model(cm),
        P(s.stages),
        m(s.micro_batches),
        V(s.virtual_stages),
        st(size_t(P)),
        chan(size_t(P) * size_t(P)),
        taken(size_t(P) * size_t(P), 0) {
    for (StageState& x : st)
      for (auto* v : {&x.f, &x.b, &x.w, &x.bw, &x.got_act, &x.got_grad})
        v->assign(size_t(m * V), 0);
  }

  const Action& at(int s, size_t k) const { return S.actions[size_t(s)][k]; }
  std::string where(int s, size_t k) const {
    return concat("stage ", s, " action ", k, " (", describe(at(s, k)), ")");
  }

  // One step of stage s: "" and advanced, "" and blocked (returns false in *moved), or an error.
  std::string step(int s, bool* moved) {
    *moved = false;
    StageState& x = st[size_t(s)];
    const size_t k = x.pos;
    const Action& a = at(s, k);
    if (a.micro < 0 || a.micro >= m || a.chunk < 0 || a.chunk >= V)
      return concat(where(s, k), " names micro-batch ", a.micro, " chunk ", a.chunk, ", outside ",
                    m, " micro-batches and ", V, " chunks");
    const size_t id = size_t(a.micro * V + a.chunk);
    const int g = a.chunk * P + s, last = P * V - 1;
    const bool local = P == 1;  // neighbouring virtual stages on this stage: no transfers
    const auto local_id = [&](int chunk) { return size_t(a.micro * V + chunk); };
    switch (a.kind) {
      case ActionKind::kForward:
        if (x.f[id]) return concat(where(s, k), " is a second forward of that micro-batch");
        if (g > 0 && !(local ? x.f[local_id(a.chunk - 1)] : x.got_act[id]))
          return concat(where(s, k), " runs before its activation was received");
        x.f[id] = 1;
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: {
        if (!x.f[id]) return concat(where(s, k), " runs before its forward");
        if (x.b[id] || x.bw[id])
          return concat(where(s, k), " is a second backward of that micro-batch");
        // The last virtual stage starts the backward itself (the loss); the others need the next
        // one's.
        const bool next_done =
            g == last ||
            (local ? (x.b[local_id(a.chunk + 1)] || x.bw[local_id(a.chunk + 1)]) : x.got_grad[id]);
        if (!next_done) return concat(where(s, k), " runs before its output gradient was received");
        (a.kind == ActionKind::kBackward ? x.bw : x.b)[id] = 1;
        break;
      }
      case ActionKind::kBackwardWeight:
        if (!x.b[id]) return concat(where(s, k), " runs before its input-gradient backward (B)");
        if (x.w[id]) return concat(where(s, k), " is a second weight-gradient backward");
        x.w[id] = 1;
        break;
      case ActionKind::kSend:
      case ActionKind::kRecv: {
        const bool act = a.payload == Payload::kActivation;
        if (!act && a.payload != Payload::kGradient)
          return concat(where(s, k), " carries neither an activation nor a gradient");
        if (local) return concat(where(s, k), " is a transfer in a one-stage pipeline");
        const bool send = a.kind == ActionKind::kSend;
        // Activations go to virtual stage g+1 and come from g-1; gradients the other way.
        const int other_g = (send == act) ? g + 1 : g - 1;
        if (other_g < 0 || other_g > last)
          return concat(where(s, k), ": virtual stage ", g, " has no neighbour that way");
        if (a.peer != other_g % P)
          return concat(where(s, k), ": the neighbouring virtual stage ", other_g,
                        " lives on stage ", other_g % P, ", not ", a.peer);
        if (send) {
          if (act ? !x.f[id] : !(x.b[id] || x.bw[id]))
            return concat(where(s, k), " sends data that has not been computed yet (its ",
                          act ? "forward" : "backward", " has not run)");
          const size_t c = size_t(s * P + a.peer);
          if (!x.send_posted) {
            chan[c].push_back({s, k});
            x.send_posted = true;
            x.send_slot = chan[c].size() - 1;
          }
          if (model == CommModel::kRendezvous && taken[c] <= x.send_slot) return "";  // blocked
          x.send_posted = false;
        } else {
          const size_t c = size_t(a.peer * P + s);
          if (taken[c] >= chan[c].size()) return "";  // blocked until the peer posts its send
          const auto [ps, pk] = chan[c][taken[c]++];
          const Action& sent = at(ps, pk);
          const int sent_g = sent.chunk * P + ps;
          if (sent.payload != a.payload || sent.micro != a.micro || sent_g != other_g)
            return concat(where(s, k), " is matched with stage ", ps, "'s send at action ", pk,
                          " (", describe(sent), "): stages ", ps, " and ", s,
                          " post their transfers in different orders");
          (act ? x.got_act : x.got_grad)[id] = 1;
        }
        break;
      }
    }
    ++x.pos;
    *moved = true;
    return "";
  }

  std::string run() {
    if (int(S.actions.size()) != P)
      return concat("the schedule has ", S.actions.size(), " lists for ", P, " stages");
    for (bool progress = true; progress;) {
      progress = false;
      for (int s = 0; s < P; ++s) {
        while (st[size_t(s)].pos < S.actions[size_t(s)].size()) {
          bool moved = false;
          std::string e = step(s, &moved);
          if (!e.empty()) return e;
          if (!moved) break;
          progress = true;
        }
      }
    }
    // Stuck: follow "waits for" from the first stuck stage to the cycle it ends in (or to a peer
    // that has finished), so the sentence names where the cycle is, not a stage merely queued
    // behind it.
    int s = -1;
    for (int q = 0; q < P && s < 0; ++q)
      if (st[size_t(q)].pos < S.actions[size_t(q)].size()) s = q;
    if (s >= 0) {
      std::vector<char> seen(size_t(P), 0);
      while (true) {
        seen[size_t(s)] = 1;
        const int peer = at(s, st[size_t(s)].pos).peer;
        if (st[size_t(peer)].pos == S.actions[size_t(peer)].size() || seen[size_t(peer)]) break;
        s = peer;
      }
      // s waits for a stage that has finished (report s) or that closes the cycle (report that
      // stage, the first of the cycle on the chain).
      const int peer = at(s, st[size_t(s)].pos).peer;
      if (st[size_t(peer)].pos < S.actions[size_t(peer)].size()) s = peer;
      const size_t k = st[size_t(s)].pos;
      const int p2 = at(s, k).peer;
      const size_t k2 = st[size_t(p2)].pos;
      const std::string peer_state =
          k2 == S.actions[size_t(p2)].size()
              ? concat("stage ", p2, " has finished its list without posting it")
              : concat("stage ", p2, " is itself stuck at action ", k2, " (", describe(at(p2, k2)),
                       ")");
      return concat("deadlock: ", where(s, k),
                    at(s, k).kind == ActionKind::kRecv ? " waits for a send from stage "
                                                       : " waits for a recv on stage ",
                    p2, ", but ", peer_state);
    }
    for (int a = 0; a < P; ++a)
      for (int b = 0; b < P; ++b) {
        const size_t c = size_t(a * P + b);
        if (taken[c] < chan[c].size())
          return concat(where(a, chan[c][taken[c]].second), " is never received by stage ", b);
      }
    const bool split = S.splits_backward();
    for (int s = 0; s < P; ++s)
      for (int i = 0; i < m; ++i)
        for (int c = 0; c < V; ++c) {
          const StageState& x = st[size_t(s)];
          const size_t id = size_t(i * V + c);
          const char* missing = !x.f[id]              ? "F"
                                : split && x.bw[id]   ? nullptr
                                : split && !x.b[id]   ? "B"
                                : split && !x.w[id]   ? "W"
                                : !split && !x.bw[id] ? "BW"
                                                      : "";
          if (missing == nullptr)
            return concat("stage ", s, " runs a fused backward of micro-batch ", i, " chunk ", c,
                          " in a schedule that splits B and W");
          if (*missing)
            return concat("stage ", s, " never runs ", missing, " of micro-batch ", i, " chunk ",
                          c);
        }
    return "";
  }
};

}  // namespace

std::string find_schedule_error(const Schedule& schedule, CommModel model) {
  if (schedule.stages < 1 || schedule.micro_batches < 1 || schedule.virtual_stages < 1)
    return concat("the schedule's shape (", schedule.stages, " stages, ", schedule.micro_batches,
                  " micro-batches, ", schedule.virtual_stages, " chunks) is not positive");
  return Checker(schedule, model).run();
}

void check_schedule(const Schedule& schedule, CommModel model) {
  const std::string e = find_schedule_error(schedule, model);
  if (!e.empty())
    ZT_THROW(ErrorKind::kInternal, "pipeline schedule ", pipe_schedule_name(schedule.kind),
             " (P=", schedule.stages, ", m=", schedule.micro_batches,
             ", V=", schedule.virtual_stages, "): ", e);
}

}  // namespace zt
