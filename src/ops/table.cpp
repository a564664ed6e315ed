// The op table: the families' entries indexed by kind, checked once, and
// what the rest of the house asks of a kind (its name, queue, put or not,
// expert home, serialized order, access rule).
#include <algorithm>
#include <array>
#include <string>

#include "ops/op.hpp"

namespace hpmoe::ops {

// One function per family file.
Family exchange_family();
Family token_exchange_family();
Family node_exchange_family();
Family rank_combine_family();
Family node_combine_family();
Family expert_gemm_family();
Family weight_grad_family();
Family swiglu_family();
Family pack_family();
Family combine_family();
Family router_family();
Family reduction_family();
Family lend_family();

namespace {

// A role that cannot be right: a put that feeds nothing at its peer, a
// non-put that claims to, a level outside the proof's range. (What a kind
// feeds is checked against the programs by the verifier.)
void check_role(const OpKind& k, const Family& f) {
  const auto& r = k.role;
  const auto fail = [&](const std::string& what) {
    throw Error(std::string("task kind '") + k.name + "' (family " + f.name + "): " + what);
  };
  constexpr auto none = TaskKind::count;
  if (k.access.put) {
    if (r.consumer == none) fail("a put names no consumer at its peer (KindRole::consumer)");
    if (r.level < 0 || r.level > 6) fail("a put's level must lie in [0, 6]");
    if (r.relay_of != none) fail("a put is no relay (KindRole::relay_of)");
  } else {
    if (r.consumer != none || r.feeds != none || r.feeds_split != none)
      fail("only a put feeds a peer (KindRole::consumer, feeds)");
    if (r.collective != taskflow::Collective::none || r.permute_first)
      fail("only a put is a framework's all-to-all (KindRole::collective, permute_first)");
    if (r.kernel_scope == taskflow::KernelScope::put_only) fail("put_only scope on a kind that is no put");
  }
}

struct Index {
  std::array<Family, 13> families{exchange_family(), token_exchange_family(), node_exchange_family(), rank_combine_family(),
                                  node_combine_family(), lend_family(), expert_gemm_family(),
                                  weight_grad_family(), swiglu_family(), pack_family(), combine_family(), router_family(),
                                  reduction_family()};
  std::array<const OpKind*, static_cast<std::size_t>(TaskKind::count)> by_kind{};
  std::vector<TaskKind> forward, backward;

  Index() {
    for (const Family& f : families)
      for (const OpKind& k : f.kinds) {
        const auto i = static_cast<std::size_t>(k.kind);
        if (i >= by_kind.size() || by_kind[i])
          throw Error(std::string("the op table lists task kind '") + k.name + "' twice or out of range (family " + f.name + ")");
        if (!k.body_f32 || !k.body_bf16)
          throw Error(std::string("task kind '") + k.name + "' has no body for every dtype (family " + f.name + ")");
        check_role(k, f);
        by_kind[i] = &k;
        (k.pass == Pass::forward ? forward : backward).push_back(k.kind);
      }
    for (std::size_t i = 0; i < by_kind.size(); ++i)
      if (!by_kind[i]) throw Error("the op table has no entry for task kind #" + std::to_string(i) + " (add it to its family)");
    for (auto* order : {&forward, &backward}) {
      std::sort(order->begin(), order->end(), [&](TaskKind a, TaskKind b) { return entry(a).order < entry(b).order; });
      for (std::size_t i = 1; i < order->size(); ++i)
        if (entry((*order)[i]).order == entry((*order)[i - 1]).order)
          throw Error(std::string("task kinds '") + entry((*order)[i]).name + "' and '" + entry((*order)[i - 1]).name +
                      "' share a place in the serialized operator order");
    }
  }
  const OpKind& entry(TaskKind k) const { return *by_kind[static_cast<std::size_t>(k)]; }
};

const Index& index() {
  static const Index table;
  return table;
}

}  // namespace

const OpKind& op(TaskKind k) {
  if (static_cast<std::size_t>(k) >= static_cast<std::size_t>(TaskKind::count))
    throw Error("task kind #" + std::to_string(static_cast<int>(k)) + " is not a kind of the op table");
  return index().entry(k);
}

std::span<const Family> families() { return index().families; }

}  // namespace hpmoe::ops

namespace hpmoe::taskflow {

const char* name(TaskKind k) {
  return static_cast<std::size_t>(k) < static_cast<std::size_t>(TaskKind::count) ? ops::op(k).name : "?";
}
namespace detail {
const KindFacts* kind_facts() {
  static const auto table = [] {
    std::array<KindFacts, static_cast<std::size_t>(TaskKind::count)> t{};
    for (std::size_t i = 0; i < t.size(); ++i) {
      const ops::OpKind& k = ops::op(static_cast<TaskKind>(i));
      t[i] = KindFacts{k.role, k.access.put, k.access.queue, k.access.expert_home};
    }
    return t;
  }();
  return table.data();
}
void bad_kind(TaskKind k) {
  throw Error("task kind #" + std::to_string(static_cast<int>(k)) + " is not a kind of the op table");
}
}  // namespace detail
const std::vector<TaskKind>& operator_order(Pass pass) {
  return pass == Pass::forward ? ops::index().forward : ops::index().backward;
}

const AccessTable& AccessTable::standard() {
  static const AccessTable table = [] {
    AccessTable t;
    for (const auto& f : ops::families())
      for (const auto& k : f.kinds) t.edit(k.kind) = k.access;
    return t;
  }();
  return table;
}

Rect AccessTable::operand(const Program& p, const Task& t, BufferId buffer, Use use) const {
  for (const Operand& o : operands(p, t))
    if (o.rect.buffer == buffer && (o.use == use || o.use == Use::accumulate)) return o.rect;
  throw Error(std::string("the access table gives a ") + name(t.kind) + " task no " +
              (use == Use::read ? "read of " : "write of ") + name(buffer));
}

}  // namespace hpmoe::taskflow
