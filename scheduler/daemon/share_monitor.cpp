#include "share_monitor.hpp"

#include <sys/resource.h>

#include <algorithm>

namespace pvgpu::daemon {

namespace {

Duration process_cpu() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    auto ns = [](const timeval& tv) {
        return static_cast<Duration>(tv.tv_sec) * kSecond + tv.tv_usec * kMicrosecond;
    };
    return ns(ru.ru_utime) + ns(ru.ru_stime);
}

// Samples shorter than this are merged with the next one, so a flood of
// queries cannot grow the window's sample list.
constexpr Duration kMinSampleGap = 10 * kMillisecond;

}  // namespace

ShareMonitor::ShareMonitor(Scheduler& sched, const GpuDevice& gpu, const Clock& clock, Timers& timers,
                           Duration window, Duration period)
    : sched_(sched), gpu_(gpu), clock_(clock), timer_(timers), window_(window), period_(period) {
    last_t_ = clock_.now();
    last_busy_ = gpu_.busy_time();
    last_policy_cpu_ = sched_.stats().policy_cpu;
    last_process_cpu_ = process_cpu();
}

void ShareMonitor::activity() {
    if (timer_.armed()) return;
    sample();  // closes the idle stretch before the work starts
    timer_.arm(clock_.now() + period_, [this] { tick(); });
}

void ShareMonitor::tick() {
    if (sample()) timer_.arm(clock_.now() + period_, [this] { tick(); });
}

void ShareMonitor::forget(EntityId id) {
    leaves_.erase(id);
    total_.erase(id);
    kernels_.erase(id);
    target_now_.erase(id);
    for (auto& s : samples_) {
        std::erase_if(s.used, [id](const auto& p) { return p.first == id; });
        std::erase_if(s.target, [id](const auto& p) { return p.first == id; });
    }
}

bool ShareMonitor::sample() {
    const Time now = clock_.now();
    const EntityTree& tree = sched_.entities();
    const Accounting& accounting = sched_.accounting();

    Sample s;
    s.end = now;
    s.dt = now - last_t_;

    // Per leaf: GPU time the scheduler measured since the last sample, and
    // whether it has work the GPU has not finished (queued or held).
    std::unordered_map<EntityId, Duration> used;
    std::vector<ShareNode> nodes;
    std::unordered_map<EntityId, std::size_t> index;
    std::vector<EntityId> ids;
    bool any_busy = false, backlog = false;
    tree.for_each([&](const Entity& e) {
        index[e.id] = nodes.size();
        ids.push_back(e.id);
        ShareNode n;
        n.weight = e.weight;
        nodes.push_back(n);
        if (e.id != kRootEntity) nodes[index.at(e.parent)].children.push_back(nodes.size() - 1);
        if (e.id == kRootEntity || !e.children.empty()) return;
        // gpu_time() includes the stint on the engine up to now, which the
        // accounting may revise down when it learns when the stint really
        // ended: count only growth past what was already counted.  (A
        // removed entity's id starts afresh through forget().)
        Duration acc = accounting.gpu_time(e.id);
        Leaf& leaf = leaves_[e.id];
        Duration d = std::max<Duration>(0, acc - leaf.last_accounted);
        leaf.last_accounted = std::max(leaf.last_accounted, acc);
        std::uint64_t k = accounting.kernels(e.id);
        std::uint64_t dk = k >= leaf.last_kernels ? k - leaf.last_kernels : k;
        leaf.last_kernels = k;
        if (dk > 0)
            for (EntityId cur = e.id; cur != kRootEntity; cur = tree.get(cur).parent) kernels_[cur] += dk;
        bool work = false;
        for (ChannelId ch : sched_.channels_of(e.id)) work = work || gpu_.pending(ch) || sched_.held(ch) > 0;
        backlog = backlog || work;
        // Backlogged: work queued or held now, or GPU time in the last
        // period (a client between two submissions is still backlogged;
        // back-to-back queries must not see it idle).
        if (work || d > 0) leaf.last_busy = now;
        bool active = leaf.last_busy >= 0 && now - leaf.last_busy < period_;
        any_busy = any_busy || active;
        nodes.back().demand = active ? 1.0 : 0.0;
        nodes.back().active = active;
        if (d > 0)
            for (EntityId cur = e.id; cur != kRootEntity; cur = tree.get(cur).parent) used[cur] += d;
    });
    std::vector<double> shares = water_fill(nodes, 0);
    target_now_.clear();
    for (std::size_t i = 1; i < ids.size(); ++i) {
        target_now_[ids[i]] = shares[i];
        if (shares[i] > 0) s.target.push_back({ids[i], shares[i] * double(s.dt)});
    }
    for (auto [id, d] : used) {
        total_[id] += d;
        s.used.push_back({id, d});
    }

    Duration busy = gpu_.busy_time();
    s.busy = busy - last_busy_;
    last_busy_ = busy;
    // Idle with demand: estimated per interval that started and ended with
    // work waiting (the interval's idle time).
    if (backlog && last_backlog_) s.idle_with_demand = std::max<Duration>(0, s.dt - s.busy);
    last_backlog_ = backlog;
    Duration pcpu = sched_.stats().policy_cpu;
    s.policy_cpu = pcpu - last_policy_cpu_;
    last_policy_cpu_ = pcpu;
    Duration proc = process_cpu();
    s.process_cpu = proc - last_process_cpu_;
    last_process_cpu_ = proc;

    last_t_ = now;
    if (s.dt > 0 && !samples_.empty() && samples_.back().dt < kMinSampleGap) {
        // Frequent queries extend the last short sample instead of piling up.
        Sample& b = samples_.back();
        b.end = s.end;
        b.dt += s.dt;
        b.used.insert(b.used.end(), s.used.begin(), s.used.end());
        b.target.insert(b.target.end(), s.target.begin(), s.target.end());
        b.busy += s.busy;
        b.idle_with_demand += s.idle_with_demand;
        b.policy_cpu += s.policy_cpu;
        b.process_cpu += s.process_cpu;
    } else if (s.dt > 0) {
        samples_.push_back(std::move(s));
    }
    while (!samples_.empty() && samples_.front().end <= now - window_) samples_.pop_front();
    return any_busy;
}

ShareMonitor::Snapshot ShareMonitor::snapshot() {
    const Time now = clock_.now();
    sample();
    Snapshot snap;
    snap.process_cpu = last_process_cpu_;
    const Time lo = now - window_;
    double w = 0, busy = 0, idle = 0, pcpu = 0, proc = 0;
    std::unordered_map<EntityId, double> used, target;
    for (const Sample& s : samples_) {
        // Only the part of a sample inside the window counts, spread evenly.
        Time start = s.end - s.dt;
        double frac = s.end <= lo ? 0.0 : start >= lo ? 1.0 : double(s.end - lo) / double(s.dt);
        double dt = double(s.dt) * frac;
        w += dt;
        busy += double(s.busy) * frac;
        idle += double(s.idle_with_demand) * frac;
        pcpu += double(s.policy_cpu) * frac;
        proc += double(s.process_cpu) * frac;
        for (auto [id, d] : s.used) used[id] += double(d) * frac;
        for (auto [id, t] : s.target) target[id] += t * frac;
    }
    snap.window = static_cast<Duration>(w);
    std::vector<double> ach, tgt;
    sched_.entities().for_each([&](const Entity& e) {
        if (e.id == kRootEntity) return;
        Share sh;
        auto tn = target_now_.find(e.id);
        sh.target_now = tn == target_now_.end() ? 0.0 : tn->second;
        if (w > 0) {
            sh.achieved = used.count(e.id) ? std::min(1.0, used[e.id] / w) : 0.0;
            sh.target_avg = target.count(e.id) ? target[e.id] / w : 0.0;
        }
        auto t = total_.find(e.id);
        sh.gpu_time = t == total_.end() ? 0 : t->second;
        auto k = kernels_.find(e.id);
        sh.kernels = k == kernels_.end() ? 0 : k->second;
        if (e.children.empty() && sh.target_avg > 0) {
            ach.push_back(sh.achieved);
            tgt.push_back(sh.target_avg);
        }
        snap.entities[e.id] = sh;
    });
    if (w > 0) {
        snap.busy_fraction = std::min(1.0, busy / w);
        snap.idle_with_demand_fraction = std::min(1.0, idle / w);
        snap.scheduler_cpu_us_per_s = pcpu / 1e3 / (w / 1e9);
        snap.process_cpu_us_per_s = proc / 1e3 / (w / 1e9);
    }
    if (!ach.empty()) snap.metrics = fairness(ach, tgt);
    return snap;
}

}  // namespace pvgpu::daemon
