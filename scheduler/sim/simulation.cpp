#include "simulation.hpp"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>

#include "event_loop.hpp"
#include "sim_gpu.hpp"
#include "workload.hpp"

namespace pvgpu::sim {

namespace {

// One reported entity: a scheduler leaf and the submit loops feeding it.
struct Leaf {
    EntityId id;
    std::vector<std::size_t> loops;
};

// Ground truth from the GPU model: who ran when.
class Measurement final : public ExecutionObserver {
public:
    Measurement(Time warmup, Time end, std::size_t nchan_hint, Duration bucket)
        : warmup_(warmup), end_(end), bucket_(bucket) {
        window_.reserve(nchan_hint);
    }

    void executed(ChannelId ch, Time start, Time stop) override {
        if (ch >= total_.size()) {
            total_.resize(ch + 1, 0);
            window_.resize(ch + 1, 0);
            buckets_.resize(ch + 1);
        }
        if (on_run) on_run(ch, start, stop);
        total_[ch] += stop - start;
        Time a = std::max(start, warmup_), b = std::min(stop, end_);
        if (b > a) window_[ch] += b - a;
        if (!busy_.empty() && busy_.back().second == start)
            busy_.back().second = stop;
        else
            busy_.push_back({start, stop});
        if (bucket_ > 0) {
            auto& v = buckets_[ch];
            for (Time t = start; t < stop;) {
                std::size_t i = static_cast<std::size_t>(t / bucket_);
                Time edge = static_cast<Time>(i + 1) * bucket_;
                Time seg_end = std::min(stop, edge);
                if (v.size() <= i) v.resize(i + 1, 0);
                v[i] += seg_end - t;
                t = seg_end;
            }
        }
    }

    Duration window(ChannelId ch) const { return ch < window_.size() ? window_[ch] : 0; }
    Duration total(ChannelId ch) const { return ch < total_.size() ? total_[ch] : 0; }
    Duration bucket(ChannelId ch, std::size_t i) const {
        return ch < buckets_.size() && i < buckets_[ch].size() ? buckets_[ch][i] : 0;
    }
    const std::vector<std::pair<Time, Time>>& busy() const { return busy_; }
    std::function<void(ChannelId, Time, Time)> on_run;  // --trace

private:
    Time warmup_, end_;
    Duration bucket_;
    std::vector<Duration> total_, window_;
    std::vector<std::vector<Duration>> buckets_;
    std::vector<std::pair<Time, Time>> busy_;
};

// Measure of [lo, hi) where some loop had outstanding work and the engine idled.
double idle_with_demand(const std::vector<std::pair<Time, Time>>& demand,
                        const std::vector<std::pair<Time, Time>>& busy, Time lo, Time hi) {
    Duration idle = 0;
    std::size_t j = 0;
    for (auto [ds, de] : demand) {
        ds = std::max(ds, lo);
        de = std::min(de, hi);
        if (de <= ds) continue;
        while (j < busy.size() && busy[j].second <= ds) ++j;
        Time cur = ds;
        for (std::size_t k = j; k < busy.size() && busy[k].first < de; ++k) {
            if (busy[k].first > cur) idle += busy[k].first - cur;
            cur = std::max(cur, busy[k].second);
            if (cur >= de) break;
        }
        if (cur < de) idle += de - cur;
    }
    return static_cast<double>(idle);
}

}  // namespace

SimResult run_simulation(const Scenario& sc, const SimOptions& opt) {
    const Time end = from_us(sc.duration_ms * 1000);
    const Time warmup = from_us(sc.warmup_ms * 1000);
    const Duration bucket = opt.series ? from_us(opt.series_interval_ms * 1000) : 0;

    EventLoop loop;
    SimGpu gpu(loop, loop, sc.gpu);
    Scheduler sched(gpu, loop, loop, make_policy(sc.policy, sc.params), sc.costs);
    Measurement meas(warmup, end, 64, bucket);
    gpu.set_observer(&meas);

    // Entity tree: a VM without pid hints is one leaf holding all its channels.
    EntityTree& tree = sched.entities();
    std::vector<Leaf> leaves;
    std::vector<std::pair<const Workload*, std::size_t>> specs;  // workload, leaf index
    auto collect = [&](auto&& self, const NodeSpec& n, std::size_t leaf) -> void {
        if (n.workload) specs.push_back({&*n.workload, leaf});
        for (const auto& c : n.children) self(self, c, leaf);
    };
    auto build = [&](auto&& self, const NodeSpec& n, EntityId parent) -> void {
        EntityKind kind = n.kind == NodeSpec::Kind::Vm ? EntityKind::Vm : EntityKind::Task;
        EntityId id = tree.add(parent, n.name, kind, n.weight);
        if (n.kind == NodeSpec::Kind::Task || !n.pid_hints) {
            leaves.push_back({id, {}});
            collect(collect, n, leaves.size() - 1);
            return;
        }
        for (const auto& c : n.children) self(self, c, id);
    };
    for (const auto& n : sc.tree) build(build, n, kRootEntity);

    // Channels and their submit loops.
    std::vector<std::unique_ptr<SubmitLoop>> loops;
    std::vector<std::size_t> loop_leaf;
    std::vector<Time> loop_failed;
    std::vector<std::uint32_t> leaf_errors(leaves.size(), 0);
    std::size_t outstanding = 0;
    std::vector<std::pair<Time, Time>> demand;  // intervals with outstanding work
    auto on_demand = [&](bool has) {
        if (has) {
            if (outstanding++ == 0) demand.push_back({loop.now(), end});
        } else if (--outstanding == 0) {
            demand.back().second = loop.now();
        }
    };
    std::map<ChannelId, std::size_t> loop_of_channel;
    for (const auto& [w, leaf] : specs) {
        for (std::uint32_t k = 0; k < w->channels; ++k) {
            ChannelId ch = sched.open_channel(leaves[leaf].id);
            std::uint64_t seed = sc.seed * 0x100000001b3ULL + loops.size() * 0x9e3779b97f4a7c15ULL;
            loops.push_back(std::make_unique<SubmitLoop>(loop, gpu, sched, ch, *w, seed, on_demand));
            loop_leaf.push_back(leaf);
            loop_failed.push_back(-1);
            leaves[leaf].loops.push_back(loops.size() - 1);
            loop_of_channel[ch] = loops.size() - 1;
        }
    }
    sched.set_error_listener([&](ChannelId ch, EntityId, std::uint32_t) {
        auto it = loop_of_channel.find(ch);
        if (it == loop_of_channel.end()) return;
        std::size_t i = it->second;
        if (loop_failed[i] < 0) loop_failed[i] = loop.now();
        ++leaf_errors[loop_leaf[i]];
        loops[i]->abandon();  // its dead channel's work will never complete
    });
    if (opt.trace) {
        std::map<ChannelId, std::string> path_of;
        for (std::size_t i = 0; i < loops.size(); ++i) path_of[loops[i]->channel()] = tree.path(leaves[loop_leaf[i]].id);
        std::ostream& os = *opt.trace;
        os << "event,start_us,end_us,entity,channel\n";
        auto us = [](Time t) {
            char b[32];
            std::snprintf(b, sizeof b, "%.3f", to_us(t));
            return std::string(b);
        };
        meas.on_run = [&os, us, path_of](ChannelId ch, Time a, Time b) {
            auto it = path_of.find(ch);
            os << "run," << us(a) << ',' << us(b) << ',' << (it == path_of.end() ? "" : it->second) << ',' << ch << '\n';
        };
        for (auto& l : loops)
            l->set_submit_listener([&os, &loop, us, path = path_of.at(l->channel())](ChannelId ch) {
                os << "submit," << us(loop.now()) << ",," << path << ',' << ch << '\n';
            });
    }
    for (auto& l : loops) l->start();

    // What the scheduler had counted, and each loop completed, by the end
    // of the warm-up: a read, nothing the simulation depends on.
    SchedulerStats stats_at_warmup;
    std::vector<std::uint64_t> completed_at_warmup(loops.size(), 0);
    if (warmup > 0 && warmup < end)
        loop.arm(warmup, [&] {
            stats_at_warmup = sched.stats();
            for (std::size_t i = 0; i < loops.size(); ++i) completed_at_warmup[i] = loops[i]->completed();
        });

    loop.run_until(end);

    // ---- results ----
    SimResult r;
    r.scenario = sc.name;
    r.policy = sc.policy;
    r.arbitration = std::string(to_string(sc.gpu.arbitration));
    r.sim_time_ms = sc.duration_ms;
    r.warmup_ms = sc.warmup_ms;
    const double window = static_cast<double>(end - warmup);

    Duration busy_window = 0;
    for (auto [a, b] : meas.busy()) {
        Time s = std::max(a, warmup), e = std::min(b, end);
        if (e > s) busy_window += e - s;
    }
    r.busy_fraction = static_cast<double>(busy_window) / window;
    r.idle_with_demand_fraction = idle_with_demand(demand, meas.busy(), warmup, end) / window;

    // When each loop wanted the GPU.
    auto loop_end = [&](std::size_t i) {
        Time e = end;
        if (loops[i]->finished()) e = std::min(e, *loops[i]->finished());
        if (loop_failed[i] >= 0) e = std::min(e, loop_failed[i]);
        return e;
    };

    // Targets: water-fill over the tree in every interval where the set of
    // active loops is constant, weighted by the interval's length.
    std::vector<Time> cuts{warmup, end};
    for (std::size_t i = 0; i < loops.size(); ++i) {
        cuts.push_back(std::clamp(loops[i]->start_time(), warmup, end));
        cuts.push_back(std::clamp(loop_end(i), warmup, end));
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    std::vector<double> target(leaves.size(), 0);
    std::vector<std::size_t> leaf_index(tree.id_bound(), SIZE_MAX);
    for (std::size_t i = 0; i < leaves.size(); ++i) leaf_index[leaves[i].id] = i;
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
        Time a = cuts[c], b = cuts[c + 1];
        Time mid = a + (b - a) / 2;
        std::vector<ShareNode> nodes(tree.id_bound());
        tree.for_each([&](const Entity& e) {
            ShareNode& n = nodes[e.id];
            n.weight = e.weight;
            n.children.assign(e.children.begin(), e.children.end());
            if (std::size_t li = leaf_index[e.id]; li != SIZE_MAX) {
                double d = 0;
                for (std::size_t i : leaves[li].loops)
                    if (loops[i]->start_time() <= mid && mid < loop_end(i)) d += loops[i]->demand();
                n.demand = std::min(1.0, d);
                n.active = d > 0;
            }
        });
        std::vector<double> shares = water_fill(nodes, kRootEntity);
        for (std::size_t i = 0; i < leaves.size(); ++i)
            target[i] += shares[leaves[i].id] * static_cast<double>(b - a) / window;
    }

    std::vector<double> achieved, targets;
    for (std::size_t li = 0; li < leaves.size(); ++li) {
        const Leaf& leaf = leaves[li];
        EntityResult e;
        e.path = tree.path(leaf.id);
        e.weight = tree.get(leaf.id).weight;
        bool all_finished = !leaf.loops.empty();
        Time fin = 0;
        double d = 0;
        for (std::size_t i : leaf.loops) {
            ChannelId ch = loops[i]->channel();
            e.gpu_time += meas.window(ch);
            e.gpu_time_total += meas.total(ch);
            e.kernels_completed += loops[i]->completed();
            e.kernels_in_window += loops[i]->completed() - completed_at_warmup[i];
            d += loops[i]->demand();
            if (loops[i]->finished())
                fin = std::max(fin, *loops[i]->finished());
            else
                all_finished = false;
        }
        e.demand = std::min(1.0, d);
        if (all_finished) e.finished_ms = to_ms(fin);
        e.accounted = sched.policy().accounted(leaf.id);
        e.measured = sched.accounting().gpu_time(leaf.id);
        e.channel_errors = leaf_errors[li];
        e.target_share = target[li];
        e.achieved_share = static_cast<double>(e.gpu_time) / window;
        e.share_error = std::abs(e.achieved_share - e.target_share);
        achieved.push_back(e.achieved_share);
        targets.push_back(e.target_share);
        r.entities.push_back(std::move(e));
    }
    r.fairness = fairness(achieved, targets);

    const double secs = sc.duration_ms / 1000.0;
    r.stats = sched.stats();
    r.window_stats = r.stats - stats_at_warmup;
    r.scheduler_cpu_us_per_s = to_us(r.stats.mechanism_cpu) / secs;
    r.policy_cpu_us_per_s = to_us(r.stats.policy_cpu) / secs;
    r.policy_counters = sched.policy().counters();
    r.context_switches = gpu.context_switches();
    r.events = loop.events_run();

    if (opt.series) {
        std::ostream& os = *opt.series;
        os << "time_ms";
        for (const auto& e : r.entities) os << ',' << e.path;
        os << '\n';
        std::size_t nb = static_cast<std::size_t>((end + bucket - 1) / bucket);
        for (std::size_t i = 0; i < nb; ++i) {
            Time b0 = static_cast<Time>(i) * bucket;
            Duration len = std::min<Duration>(bucket, end - b0);
            char stamp[32];
            std::snprintf(stamp, sizeof stamp, "%.3f", to_ms(b0 + len));
            os << stamp;
            for (const Leaf& leaf : leaves) {
                Duration t = 0;
                for (std::size_t l : leaf.loops) t += meas.bucket(loops[l]->channel(), i);
                os << ',' << static_cast<double>(t) / static_cast<double>(len);
            }
            os << '\n';
        }
    }
    return r;
}

}  // namespace pvgpu::sim
