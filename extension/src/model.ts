/**
 * What the Mesh panel and the status bar show: the server's /monarch/meshes answer,
 * fetched once a second while someone shows it, and not at all when nobody does.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IProc {
  rank: number;
  mesh: string;
  host: string;
  pid: number;
  state: string;
  actors: string[];
  buffers: unknown;
  cpu: number | null;
  rss_mb: number | null;
  uss_mb: number | null; // its own memory (the latest reading; read every few samples)
  gpu_util: number | null;
  cpu_hist: number[];
  rss_hist: number[];
  gpu_hist: number[];
}

export interface IMesh {
  name: string;
  alive: boolean;
  persistent: boolean;
  hosts: string[];
  procs: IProc[];
  lease_s: number | null;
  detached_s: number;
  gpu: boolean;
  hosts_gone?: number; // agents of this mesh that no longer run (a job that lost hosts)
  hosts_silent?: number; // agents that did not answer the last look (their ranks read 'unreachable')
}

export interface IMeshes {
  meshes: IMesh[];
  kernel_mesh: string | null;
  time: number;
}

export const PERIOD_MS = 1000; // never poll faster than this
export const IDLE_MS = 5000;

export async function api(path: string, init: RequestInit = {}): Promise<any> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'monarch', 'meshes', path);
  const reply = await ServerConnection.makeRequest(url, init, settings);
  if (!reply.ok) {
    throw new Error(`${reply.status} ${await reply.text()}`);
  }
  return reply.json();
}

/** States of a rank that does not answer, as its host's agent names them (core/silent_procs.py SHORT),
 * and of a rank whose host's agent does not answer (telemetry/server.py). */
export const STUCK = new Set(['stopped (signal)', 'held by a tracer', 'waiting on I/O', 'unreachable']);

/** A rank whose host's agent no longer runs (telemetry/server.py LOST): red, as dead, but
 * not counted among the procs nor respawned (its host is gone). */
export const LOST = 'host gone';

/** Red: a dead rank, or one whose host is gone. */
export function lost(state: string): boolean {
  return state === 'dead' || state === LOST;
}

/** "0-31,40": ranks in order, runs as first-last (core/mesh_tables.py's ranges). */
export function ranges(ranks: number[]): string {
  const r = [...ranks].sort((a, b) => a - b);
  const parts: string[] = [];
  for (let i = 0; i < r.length; ) {
    let j = i;
    while (j + 1 < r.length && r[j + 1] === r[j] + 1) {
      j++;
    }
    parts.push(i === j ? `${r[i]}` : `${r[i]}-${r[j]}`);
    i = j + 1;
  }
  return parts.join(',');
}

/** Paused in the debugger, or not answering: amber where dead is red. */
export function held(state: string): boolean {
  return state.startsWith('paused') || STUCK.has(state);
}

export interface ICounts {
  procs: number;
  dead: number;
  paused: number;
  stuck: number;
  hostsGone: number;
  goneRanks: number[]; // the ranks a gone host last had (as far as the server saw them)
  hostsSilent: number;
  silentRanks: number[];
}

export function counts(m: IMesh): ICounts {
  const of = (state: string) => m.procs.filter(p => p.state === state).map(p => p.rank);
  const goneRanks = of(LOST);
  const silentRanks = of('unreachable');
  const dead = m.procs.filter(p => p.state === 'dead').length;
  const paused = m.procs.filter(p => p.state.startsWith('paused')).length;
  const stuck = m.procs.filter(p => STUCK.has(p.state) && p.state !== 'unreachable').length;
  return {
    procs: m.procs.length - goneRanks.length, dead, paused, stuck, hostsGone: m.hosts_gone || 0, goneRanks,
    hostsSilent: m.hosts_silent || 0, silentRanks
  };
}

const hosts = (n: number): string => `${n} host${n > 1 ? 's' : ''}`;
const which = (ranks: number[]): string =>
  !ranks.length ? '' : ` (rank${ranks.length > 1 ? 's' : ''} ${ranges(ranks)})`;

/** The header's words for what needs a look: `· 1 host gone (ranks 20-39) · 1 host not answering
 * (ranks 40-59) · 1 dead · 2 paused · 1 not answering`. A host that went before the server
 * ever heard from it is counted, its ranks not named. */
export function countsText(c: ICounts): string {
  return (c.hostsGone ? ` · ${hosts(c.hostsGone)} gone${which(c.goneRanks)}` : '') +
    (c.hostsSilent ? ` · ${hosts(c.hostsSilent)} not answering${which(c.silentRanks)}` : '') +
    (c.dead ? ` · ${c.dead} dead` : '') + (c.paused ? ` · ${c.paused} paused` : '') +
    (c.stuck ? ` · ${c.stuck} not answering` : '');
}

export function leaseText(m: IMesh): string {
  if (m.lease_s === null || m.lease_s === undefined) {
    return 'no lease';
  }
  const left = Math.max(0, m.lease_s - (m.detached_s || 0));
  return `lease ${Math.round(left / 60)} min`;
}

export function stateLabel(s: string): string {
  if (s === 'in __cells__.run') {
    return 'running cell';
  }
  if (s.startsWith('in __cells__.')) {
    return 'busy (push/pull)';
  }
  if (s.startsWith('in ')) {
    return `in endpoint ${s.slice(3)}`;
  }
  return s;
}

/** Fetches while at least one watcher wants it; tells every listener on each answer. */
export class MeshModel {
  data: IMeshes | null = null;
  error = '';
  kernelId: string | null = null;
  private watchers = new Set<string>();
  private listeners: Array<() => void> = [];
  private timer: number | null = null;
  private inFlight = false;

  onChange(fn: () => void): void {
    this.listeners.push(fn);
  }

  /** ``who`` shows the data now (true) or no longer (false). */
  watch(who: string, on: boolean): void {
    const before = this.watchers.size;
    if (on) {
      this.watchers.add(who);
    } else {
      this.watchers.delete(who);
    }
    if (this.watchers.size && (!before || (on && who === 'panel'))) {
      if (this.timer !== null) {
        window.clearTimeout(this.timer); // the panel wants fresh data now, then every second
      }
      void this.tick();
    } else if (!this.watchers.size && this.timer !== null) {
      window.clearTimeout(this.timer);
      this.timer = null;
    }
  }

  /** Once a second while the panel is shown or the notebook in front has a mesh; every
   * IDLE_MS when only the status bar waits for a notebook that has none yet. */
  private async tick(): Promise<void> {
    this.timer = null;
    await this.refresh();
    if (!this.watchers.size || this.timer !== null) {
      return;
    }
    const busy = this.watchers.has('panel') || !!this.kernelMesh();
    this.timer = window.setTimeout(() => void this.tick(), busy ? PERIOD_MS : IDLE_MS);
  }

  async refresh(): Promise<void> {
    if (this.inFlight || document.hidden) {
      return;
    }
    this.inFlight = true;
    try {
      const q = this.kernelId ? `?kernel=${encodeURIComponent(this.kernelId)}` : '';
      this.data = await api(q);
      this.error = '';
    } catch (e) {
      this.error = String(e);
    } finally {
      this.inFlight = false;
    }
    this.listeners.forEach(fn => fn());
  }

  kernelMesh(): IMesh | null {
    const d = this.data;
    if (!d || !d.kernel_mesh) {
      return null;
    }
    return d.meshes.find(m => m.name === d.kernel_mesh) ?? null;
  }
}
