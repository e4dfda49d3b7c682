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

/** States of a rank that does not answer, as its host's agent names them (core/silent_procs.py SHORT). */
export const STUCK = new Set(['stopped (signal)', 'held by a tracer', 'waiting on I/O']);

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
}

export function counts(m: IMesh): ICounts {
  const dead = m.procs.filter(p => p.state === 'dead').length;
  const paused = m.procs.filter(p => p.state.startsWith('paused')).length;
  const stuck = m.procs.filter(p => STUCK.has(p.state)).length;
  return { procs: m.procs.length, dead, paused, stuck, hostsGone: m.hosts_gone || 0 };
}

/** The header's words for what needs a look: `· 1 host gone · 1 dead · 2 paused · 1 not answering`
 * (a gone host's procs are not listed: its agent cannot say what they were). */
export function countsText(c: ICounts): string {
  return (c.hostsGone ? ` · ${c.hostsGone} host${c.hostsGone > 1 ? 's' : ''} gone` : '') +
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
